"""The names of the blobs a checkpoint of this package carries beside its
tensors (docs/python.md): the pickled skeleton, the RNG state, and the map
of tensors saved in pieces that older multi-rank checkpoints hold."""

STRUCTURE_BLOB = "structure.pkl"
RNG_BLOB = "rng.pkl"
PARTS_BLOB = "parts.pkl"  # read only: older multi-rank checkpoints' map of tensors saved in pieces
