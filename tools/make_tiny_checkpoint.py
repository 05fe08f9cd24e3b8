"""Write a tiny random K3 / Kimi-Linear checkpoint in the exact published layout.

    python tools/make_tiny_checkpoint.py --preset tiny-k3 --out /tmp/tiny --seed 0 --shards 3

The writer lives in `p2pk3.checkpoint.tiny` (tests, benchmarks and the training export use it).
"""

from p2pk3.checkpoint.tiny import main

if __name__ == "__main__":
    raise SystemExit(main())
