"""Files opened safely, below every layer that reads or writes one: checkpoint inputs as regular files
only, and side files only from inside the checkpoint (``inputs``); its JSON files read capped, one line
naming a bad one (``json_files``); our entries in folders other users can write to, never through a symlink
(``shared_folders``).
"""
