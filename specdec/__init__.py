"""specdec: exact speculative decoding with a PyTorch DFlash drafter across MLX and transformers verifiers.

Importing this package loads only torch and numpy; mlx and transformers load inside the verifier and
bridge modules that need them.
"""

from specdec.protocols import Drafter, MemoryProbe, Verifier, check_compatible

__version__ = "0.1.0"
__all__ = ["Drafter", "MemoryProbe", "Verifier", "__version__", "check_compatible"]
