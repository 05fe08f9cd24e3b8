"""The training library of the embedded models (tools/train_tiny.py, tools/train_docs.py), one job per module:

* `model`: the small K3 config (`tiny_config`), its initialisation with float master experts for MXFP4 QAT
  (`init_stage`), canonical checkpoint names of the trained weights (`canonical_state_dict`);
* `balance`: router load balancing without an aux loss (`RouterTap`, `qb_update`, `sign_update`, `imbalance`);
* `evaluate`: the training / scoring forward (`forward_batch`), held-out NLL and perplexity, greedy decoding,
  the export reloaded through the real loader, perplexity through a local ring, the shipped eval slice;
* `export`: the checkpoint directory (weights, tokenizer, generation config);
* `pydoc_topics`: the tiny model's data (`pydoc_data.topics`, split by topic hash, chat pairs from headings);
* `tiny_run`: the tiny-k3-pydoc run (training loop, `finish`: export + evaluation), `tiny_card` its model card;
* `runlog`: the run's log line (stdout and train.log).
"""
