"""Benchmark: do committed run records reproduce under today's code?

Training is chaotic: the NS-RNN on marked reversal sits on a plateau
(validation CE difference ~0.2-0.3) until, at some epoch, it learns the task
(~0.005). When that happens moves with any change that rounds differently,
even where the code computes the same function. This script reruns the first
--epochs epochs of the paper's protocol for one task, model and some
learning rates, restarts 0..R-1 (the seeds of the committed records, then
new ones), with `python -m nsrnn_jax.reproduce --set=max_epochs=E
--set=run_test=False` (records marked custom, in a scratch --results), and
compares every rerun with the committed record of the same grid point and
restart over those epochs: the first epoch whose validation CE difference is
below --threshold (None: not within E epochs) and epoch 1's training loss.

Prints a table, saves JSON (benchmarks/results/rerun_records_<task>_<model>
.json; README's table is generated from it by report.py). Uses the default
persistent compilation cache (a rerun of a model whose programs it holds
starts at once).

  python benchmarks/rerun_records.py --task=marked_reversal --model=ns \\
      --learning_rates=0.01,0.005 --restarts=10 --epochs=9 --workers=2
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import machine  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import run_records  # pylint: disable=g-import-not-at-top,wrong-import-position
from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def first_below(record, epochs, threshold):
  """The first epoch (1-based, <= epochs) whose validation CE difference is
  below threshold, or None."""
  for e in record["epochs"][:epochs]:
    if e["valid_ce_diff"] is not None and e["valid_ce_diff"] < threshold:
      return e["epoch"]
  return None


def compare(rerun, committed, epochs, threshold):
  """One row: a rerun record beside the committed one (None: no record)."""
  row = {"learning_rate": rerun["learning_rate"],
         "stack_size": rerun["stack_size"], "restart": rerun["restart"],
         "rerun_first": first_below(rerun, epochs, threshold),
         "rerun_epoch1_loss": rerun["epochs"][0]["train_loss"],
         "rerun_curve": [e["valid_ce_diff"] for e in rerun["epochs"]],
         "committed": committed is not None}
  if committed is not None:
    row.update(
        recorded_first=first_below(committed, epochs, threshold),
        recorded_epoch1_loss=committed["epochs"][0]["train_loss"],
        recorded_curve=[e["valid_ce_diff"]
                        for e in committed["epochs"][:epochs]],
        recorded_code=committed.get("code"))
  return row


def summarize(rows):
  """Per learning rate: how many runs learned within the epochs, recorded
  and rerun, and how many committed restarts changed their outcome."""
  out = {}
  for lr in sorted({r["learning_rate"] for r in rows}, reverse=True):
    mine = [r for r in rows if r["learning_rate"] == lr]
    old = [r for r in mine if r["committed"]]
    learned = lambda key, rs: sum(r[key] is not None for r in rs)
    out[f"{lr:g}"] = {
        "committed_runs": len(old),
        "recorded_learned": learned("recorded_first", old),
        "rerun_learned_on_committed": learned("rerun_first", old),
        "outcome_changed": sum((r["recorded_first"] is None)
                               != (r["rerun_first"] is None) for r in old),
        "first_epoch_changed": sum(r["recorded_first"] != r["rerun_first"]
                                   for r in old),
        "runs": len(mine), "rerun_learned": learned("rerun_first", mine)}
  return out


# Loss and gradient at initialisation on a record's first training batches,
# run by whichever nsrnn_jax is first on the path (the current checkout's or
# a worktree's of --against): argv = record path, output .npz, batches.
_INIT_GRADIENTS = r"""
import json, sys
import numpy as np
import jax
from ml_collections import config_dict
from nsrnn_jax import data, train
record, out, num = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = config_dict.ConfigDict(json.load(open(record))["config"])
splits = data.from_config(config, need_test=False)
model = train.build_model(config)
state = train.create_train_state(config, jax.random.key(config.param_seed),
                                 model)
name = lambda path: "/".join(str(getattr(k, "key", k)) for k in path)
arrays = {"param:" + name(p): np.asarray(v) for p, v in
          jax.tree_util.tree_flatten_with_path(state.params)[0]}
for i in range(num):
  batch = train.make_batch(splits.train[i].symbols)
  loss, grads = jax.value_and_grad(train.loss_fn)(state.params, model.apply,
                                                  batch)
  arrays[f"batch{i}"] = np.asarray(batch["symbols"])
  arrays[f"loss{i}"] = np.asarray(loss)
  arrays.update({f"grad{i}:" + name(p): np.asarray(v) for p, v in
                 jax.tree_util.tree_flatten_with_path(grads)[0]})
np.savez(out, **arrays)
"""


# The first epochs of a record's run, trained by whichever nsrnn_jax is first
# on the path: argv = record path, workdir, epochs; prints the epochs'
# (train loss, validation CE difference) as one JSON line.
_FIRST_EPOCHS = r"""
import json, sys
from ml_collections import config_dict
from nsrnn_jax import train
record, workdir, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = json.load(open(record))["config"]
config.update(max_epochs=epochs, run_test=False, progress_bar=False)
train.train_and_evaluate(config_dict.ConfigDict(config), workdir)
rows = [json.loads(line) for line in open(workdir + "/metrics.jsonl")]
print(json.dumps([[r["train_loss"], r["valid_ce_diff"]] for r in rows
                  if "valid_ce_diff" in r]))
"""


def run_under(root, code, *args):
  """Runs the Python `code` (with `args`) on the nsrnn_jax of checkout
  `root`; its stdout. Exits with a one-line error if it fails."""
  proc = subprocess.run([sys.executable, "-c", code, *map(str, args)],
                        cwd=root, env=dict(os.environ, PYTHONPATH=root),
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    cli.fail(f"a run under {root} failed: "
             + (proc.stderr.strip().splitlines() or ["no output"])[-1])
  return proc.stdout


def first_epochs(root, record, workdir, epochs):
  """(train loss, validation CE difference) of a record's first epochs,
  trained by the nsrnn_jax of checkout `root`."""
  out = run_under(root, _FIRST_EPOCHS, record, workdir, epochs)
  return json.loads(out.strip().splitlines()[-1])


def init_gradients(root, record, out, batches):
  """_INIT_GRADIENTS's arrays under the nsrnn_jax of checkout `root`."""
  run_under(root, _INIT_GRADIENTS, record, out, batches)
  return dict(np.load(out))


def compare_init_gradients(now, then):
  """Where two codes' parameters, batches, losses and gradients differ."""
  def rel(prefix):
    keys = [k for k in now if k.startswith(prefix)]
    return max(float(np.max(np.abs(now[k] - then[k]))
                     / max(float(np.max(np.abs(then[k]))), 1e-30))
               for k in keys)
  same = lambda prefix: all(np.array_equal(now[k], then[k]) for k in now
                            if k.startswith(prefix))
  if sorted(now) != sorted(then):
    cli.fail("the two codes' parameter trees differ")
  return {"params_equal": same("param:"), "batches_equal": same("batch"),
          "loss_max_rel_diff": rel("loss"), "grad_max_rel_diff": rel("grad")}


def against_revision(revision, record, batches, epochs, tmp):
  """The gradient at initialisation under `revision` and under this code,
  and whether `revision` retrains the record's first epochs exactly."""
  tree = os.path.join(tmp, "against")
  added = subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach",
                          "-q", tree, revision], capture_output=True,
                         text=True, check=False)
  if added.returncode:
    reason = added.stderr.strip().splitlines()
    cli.fail(f"--against {revision!r}: git cannot check it out"
             + (f" ({reason[-1]})" if reason else ""))
  try:
    then = init_gradients(tree, record, os.path.join(tmp, "then.npz"),
                          batches)
    retrained = first_epochs(tree, record, os.path.join(tmp, "then_run"),
                             epochs)
  finally:
    subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force",
                    tree], check=False)
  now = init_gradients(REPO, record, os.path.join(tmp, "now.npz"), batches)
  recorded = [[e["train_loss"], e["valid_ce_diff"]]
              for e in run_records.read_json(record)["epochs"][:epochs]]
  return {"revision": revision, "record": os.path.relpath(record, REPO),
          "batches": batches, **compare_init_gradients(now, then),
          "retrained_epochs": epochs, "retrained": retrained,
          "recorded": recorded, "retrained_equals_record":
              retrained == recorded}


def main():
  parser = cli.OneLineArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--task", default="marked_reversal")
  parser.add_argument("--model", default="ns")
  parser.add_argument("--learning_rates", default="0.01,0.005")
  parser.add_argument("--stack_size", type=int, default=2,
                      help="m of JM/Gref (ignored by lstm/ns)")
  parser.add_argument("--restarts", type=cli.positive_int, default=10,
                      help="restarts 0..R-1; those with committed records "
                      "are compared, the others counted")
  parser.add_argument("--epochs", type=cli.positive_int, default=9)
  parser.add_argument("--threshold", type=float, default=0.05,
                      help="validation CE difference (nats/symbol) below "
                      "which a run has learned the task")
  parser.add_argument("--set", action="append", default=[],
                      metavar="FIELD=VALUE",
                      help="a config override for the reruns (e.g. "
                      "dtype=float64, with JAX_ENABLE_X64=1 set)")
  parser.add_argument("--workers", type=cli.positive_int,
                      default=os.cpu_count() or 1)
  parser.add_argument("--workdir", default=None,
                      help="keep the runs here (a rerun of the command "
                      "resumes them); default a temporary directory")
  parser.add_argument("--against", default=None, metavar="REVISION",
                      help="also compare the loss and gradient at "
                      "initialisation on the first batches of "
                      "--against_record under this git revision and under "
                      "the current code (parameters and batches must be "
                      "equal: then the codes differ in rounding alone)")
  parser.add_argument("--against_epochs", type=int, default=3,
                      help="with --against: epochs of --against_record's "
                      "run retrained under REVISION, compared with the "
                      "record exactly")
  parser.add_argument("--against_record", default=None,
                      help="a committed record (default: restart 1 of the "
                      "first learning rate)")
  parser.add_argument("--conditions", default=None,
                      help="how the run was made (recorded in the JSON)")
  parser.add_argument("--out", type=cli.output_file, default=None)
  args = parser.parse_args()
  if args.against and not machine.is_revision(args.against):
    # Checked before the reruns, which take long.
    cli.fail(f"--against {args.against!r}: no such git revision")
  out = args.out or os.path.join(
      RESULTS, f"rerun_records_{args.task}_{args.model}.json")
  info = machine.machine_info()

  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.workdir or os.path.join(tmp, "runs")
    results = os.path.join(workdir, "rerun_results")
    argv = [sys.executable, "-m", "nsrnn_jax.reproduce",
            f"--task={args.task}", f"--models={args.model}",
            f"--learning_rates={args.learning_rates}",
            f"--stack_sizes={args.stack_size}",
            f"--restarts={args.restarts}", f"--workers={args.workers}",
            f"--set=max_epochs={args.epochs}", "--set=run_test=False",
            f"--workdir={workdir}", f"--results={results}"] + [
                f"--set={x}" for x in args.set]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, check=False)
    if proc.returncode != 0:
      cli.fail(f"reproduce exited with {proc.returncode}")
    seconds = time.perf_counter() - start
    reruns = run_records.load_records(results, args.task)
    against = None
    if args.against:
      lr = float(args.learning_rates.split(",")[0])
      stack_size = (args.stack_size if args.model in run_records.STACK_MODELS
                    else None)
      record = args.against_record or os.path.join(
          REPO, "results", run_records.RunSpec(args.task, args.model, lr,
                                               stack_size, 1).record_path)
      against = against_revision(args.against, os.path.abspath(record), 3,
                                 args.against_epochs, tmp)
    codes = sorted({json.dumps(r.get("code"), sort_keys=True)
                    for r in reruns})

  rows = []
  for rec in sorted(reruns, key=lambda r: (-r["learning_rate"],
                                           r["restart"])):
    path = os.path.join(REPO, "results", run_records.RunSpec(
        rec["task"], rec["model"], rec["learning_rate"], rec["stack_size"],
        rec["restart"]).record_path)
    committed = run_records.read_json(path) if os.path.isfile(path) else None
    rows.append(compare(rec, committed, args.epochs, args.threshold))
  summary = summarize(rows)

  print(f"\n{args.model} on {args.task}: first epoch with validation CE "
        f"difference < {args.threshold:g} within {args.epochs} epochs "
        f"(-: none), committed record / rerun, {machine.device_label(info)}")
  for row in rows:
    recorded = (row.get("recorded_first") or "-") if row["committed"] else ""
    print(f"  lr {row['learning_rate']:<7g} restart {row['restart']:<2d} "
          f"{recorded!s:>4} / {row['rerun_first'] or '-'!s:<4}")
  for lr, s in summary.items():
    print(f"lr {lr}: learned within {args.epochs} epochs: committed "
          f"{s['recorded_learned']}/{s['committed_runs']}, rerun of those "
          f"{s['rerun_learned_on_committed']}/{s['committed_runs']} "
          f"({s['outcome_changed']} changed); all reruns "
          f"{s['rerun_learned']}/{s['runs']}")
  if against:
    print(f"at initialisation, {against['record']}, first "
          f"{against['batches']} batches, {args.against} vs now: parameters "
          f"{'equal' if against['params_equal'] else 'DIFFER'}, batches "
          f"{'equal' if against['batches_equal'] else 'DIFFER'}, loss max "
          f"rel. diff {against['loss_max_rel_diff']:.1e}, gradient "
          f"{against['grad_max_rel_diff']:.1e}; its first "
          f"{against['retrained_epochs']} epochs retrained under "
          f"{args.against} "
          f"{'equal' if against['retrained_equals_record'] else 'DIFFER from'}"
          " the record")
  result = {"benchmark": "rerun_records", "machine": info,
            "device": machine.device_label(info),
            "date": time.strftime("%Y-%m-%d"),
            "source_revision": machine.source_revision(), "task": args.task,
            "model": args.model, "epochs": args.epochs,
            "threshold": args.threshold, "restarts": args.restarts,
            "workers": args.workers, "overrides": args.set,
            "wall_s": seconds,
            "rerun_code": [json.loads(c) for c in codes],
            "conditions": args.conditions, "against": against,
            "rows": rows,
            "summary": summary}
  machine.save_result(out, result)


if __name__ == "__main__":
  main()
