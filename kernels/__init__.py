"""p2pk3 compute kernels (installed as `p2pk3_kernels`).

Each op lives in `<op>.py` (Triton) beside `<op>_ref.py` (plain torch, same signature). `ops` is the one
place that picks between them: Triton on CUDA, torch elsewhere; `P2PK3_KERNELS=triton|torch` forces a
path (with `TRITON_INTERPRET=1` the Triton kernels run on the CPU). Kernels know nothing of the model:
they take tensors and numbers.
"""
