"""p2pk3: a peer-to-peer inference engine for Kimi K3."""
__version__ = "0.1.0"
