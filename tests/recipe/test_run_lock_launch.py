"""Two real launches of the recipe into one output folder at the same moment: one is refused
on every rank by the output-folder lock, naming the live run; the other's files are intact."""

from __future__ import annotations

import json
import random
import threading

from _launch import REPO_ROOT, run_torchrun

from recipes.run_folder import read_metrics

RECIPE = REPO_ROOT / "recipes" / "pretrain.py"
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows outrageous fortune".split()


def test_two_launches_into_one_folder(tmp_path):
    random.seed(0)
    lines = [" ".join(random.choice(WORDS) for _ in range(12)) for _ in range(400)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:300]))
    (tmp_path / "val.txt").write_text("\n".join(lines[300:]))
    out = tmp_path / "shared"
    common = ["--model", "tiny", "--micro_batch_size", "1", "--max_steps", "12", "--sync_every", "4",
              "--num_groups", "2", "--log_every", "1", "--eval_every", "0", "--save_final_model", "false",
              "--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "val.txt"),
              "--vocab_size", "300", "--seq_len", "64", "--output_dir", str(out)]
    results = {}

    def launch(name):
        results[name] = run_torchrun(2, RECIPE, *common, "--run_name", name, "--cache_dir",
                                     str(tmp_path / f"cache-{name}"), timeout=400, env={"WANDB_MODE": "offline"})

    threads = [threading.Thread(target=launch, args=(n,)) for n in ("run-a", "run-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [n for n, r in results.items() if r.returncode == 0]
    refused = [n for n, r in results.items() if r.returncode != 0]
    assert len(ok) == 1 and len(refused) == 1, {n: (r.returncode, r.stderr[-2000:]) for n, r in results.items()}
    err = results[refused[0]].stderr
    assert f"the output folder {out} is in use by run '{ok[0]}'" in err, err[-3000:]
    done = json.loads((out / "all_results.json").read_text())
    assert done["run_name"] == ok[0]
    records = read_metrics(str(out / "metrics.jsonl"))
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 12, steps  # one run's records, not interleaved
    assert not (out / ".fl_accel.lock").exists()  # released at the end
