"""The writer: output decisions (dtype, tying, LoRA, shards), the streaming safetensors writer, the HF
folder's other files, atomic publish, and the comparison with a reference folder.

It takes a ``CheckpointPlan`` and knows no reader: ``merge_pipeline.pipeline`` hands it the plan.
"""
