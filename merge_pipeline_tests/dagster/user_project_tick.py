"""One tick of a scaffolded component's sensor in a user's Dagster project, then each run it requested,
executed as the daemon's run worker would, on the instance of ``$DAGSTER_HOME``. Run by the Python of the
project's venv (test_user_project.py), where only the project and what it installed are importable:

    python user_project_tick.py PROJECT_ROOT PREFIX     prints {partition key: run succeeded}
"""

import json
import sys
from pathlib import Path

import dagster as dg


def tick_and_run(root: Path, prefix: str) -> dict[str, bool]:
    defs = dg.load_from_defs_folder(path_within_project=root)  # what the project's definitions.py loads
    with dg.DagsterInstance.get() as instance:
        sensor = defs.resolve_sensor_def(f"{prefix}__new_checkpoint_sensor")
        ticked = sensor(dg.build_sensor_context(instance=instance, resources=defs.resources))
        for added in ticked.dynamic_partitions_requests:
            instance.add_dynamic_partitions(added.partitions_def_name, list(added.partition_keys))
        return {
            request.partition_key: defs.resolve_job_def(request.job_name or sensor.job_name)
            .execute_in_process(partition_key=request.partition_key, run_config=request.run_config, instance=instance)
            .success
            for request in ticked.run_requests
        }


if __name__ == "__main__":
    print(json.dumps(tick_and_run(Path(sys.argv[1]), sys.argv[2])))
