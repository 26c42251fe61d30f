"""The names of a Hugging Face model folder's weight files, apart from the code that reads them: the Dagster
code location names them without importing torch."""

# A model folder's weight files, in any framework's format: never copied as side files, never downloaded whole.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
