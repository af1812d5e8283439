"""The peers suite's training workers (``bench/peers.py``): torchft's DiLoCo / Streaming DiLoCo
and Accelerate's LocalSGD, each written as a user of that library writes it, on the recipe's
model, data, optimizer and LR schedule (:mod:`bench.peers_workers.common`).

Each worker is a torchrun script (``torchrun ... bench/peers_workers/<tool>.py --flags``) that
writes ``metrics.jsonl`` (training and evaluation records, the recipe's keys) and
``all_results.json`` (whole-run figures; its presence marks a finished launch) into
``--output_dir``. They import the recipe's pieces (``recipes.*``) and nothing of fl_accel.
"""
