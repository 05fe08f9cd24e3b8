"""Tools beside the engine (not installed with it): benchmarks, fuzzing, soak, host calibration, mutation score,
and the training of the embedded models (scripts `train_tiny.py`, `train_docs.py`, `eval_demo.py` over the
library `trainlib/` and the corpus builder `doc_corpus/`). Each script runs as `python tools/X.py` or
`python -m tools.X` from the repository root."""
