"""The memory-efficient ops; each folder holds api.py, reference.py and implementations."""
