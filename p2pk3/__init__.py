"""p2pk3: a peer-to-peer inference engine for Kimi K3."""

from pathlib import Path

__version__ = "0.1.0"


def default_model_dir() -> Path:
    """The embedded default model `k3-docs` (a small K3 trained on the Python docs and the Linux man pages,
    shipped with the package; the previous, smaller `tiny-k3-pydoc` ships beside it). Here, not in the
    engine, so that commands that only name the model do not import torch."""
    return Path(__file__).resolve().parent / "assets" / "k3-docs"
