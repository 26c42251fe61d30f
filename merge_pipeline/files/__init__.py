"""Files opened safely, below every layer that reads or writes one: checkpoint inputs as regular files
only, and side files only from inside the checkpoint (``inputs``); our entries in folders other users can
write to, never through a symlink (``shared_folders``).
"""
