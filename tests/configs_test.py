"""Tests of configs/*.py and train.validate_config (incl. the CLI error)."""

import glob
import importlib
import os
import re
import subprocess
import sys

import pytest

from configs import default
from nsrnn_jax import models
from nsrnn_jax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("marked_reversal", "unmarked_reversal", "padded_reversal", "dyck",
         "hardest_cfl")
MODELS = ("lstm", "jm", "gref", "ns")
# Paper section 5.5: (Q, S) of the NS-RNN per task.
PAPER_QS = {"marked_reversal": (2, 2), "unmarked_reversal": (2, 2),
            "dyck": (2, 2), "padded_reversal": (3, 2), "hardest_cfl": (3, 3)}


def _load(name):
  return importlib.import_module(f"configs.{name}").get_config()


def test_there_is_one_config_per_task_and_model():
  names = {os.path.basename(p)[:-3]
           for p in glob.glob(os.path.join(REPO, "configs", "*_*.py"))}
  assert {f"{t}_{m}" for t in TASKS for m in MODELS} <= names


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("model", MODELS)
def test_task_model_configs_have_paper_settings(task, model):
  config = _load(f"{task}_{model}")
  train.validate_config(config)
  assert (config.task, config.model) == (task, model)
  if model == "ns":
    assert (config.num_states, config.num_stack_symbols) == PAPER_QS[task]
  assert config.learning_rate in config.learning_rate_grid
  assert tuple(config.learning_rate_grid) == (0.01, 0.005, 0.001, 0.0005)
  if model in ("jm", "gref"):
    assert config.stack_embedding_size in config.stack_embedding_size_grid
  # Protocol fields are inherited unchanged from default.py.
  base = default.get_config()
  for field in ("batch_size", "clip_norm", "max_epochs", "lr_decay_factor",
                "lr_decay_patience", "early_stopping_patience",
                "train_min_length", "train_max_length", "test_max_length"):
    assert config[field] == base[field], field
  doc = importlib.import_module(f"configs.{task}_{model}").__doc__
  assert f"--config=configs/{task}_{model}.py" in doc


def test_default_is_the_paper_protocol():
  c = default.get_config()
  train.validate_config(c)
  assert (c.batch_size, c.num_train_batches, c.num_valid_batches) == (
      10, 1000, 100)
  assert (c.clip_norm, c.adam_b1, c.adam_b2, c.adam_eps) == (
      5.0, 0.9, 0.999, 1e-8)
  assert (c.lr_decay_factor, c.lr_decay_patience, c.lr_decay_threshold,
          c.early_stopping_patience, c.max_epochs) == (0.9, 5, 1e-4, 10, 200)
  assert (c.train_min_length, c.train_max_length, c.test_min_length,
          c.test_max_length, c.test_strings_per_length) == (40, 80, 40, 100,
                                                           100)
  assert c.test_seed == 0 and c.hidden_size == 20


def test_every_default_field_is_commented():
  lines = open(os.path.join(REPO, "configs", "default.py")).read().splitlines()
  assign = re.compile(r"^  config\.(\w+) = ")
  fields = []
  for i, line in enumerate(lines):
    m = assign.match(line)
    if not m:
      continue
    fields.append(m.group(1))
    # Walk up over a block of assignments to the comment that heads it.
    j = i - 1
    while j >= 0 and assign.match(lines[j]):
      j -= 1
    assert lines[j].strip().startswith("#"), f"{m.group(1)} has no comment"
  assert set(fields) == set(default.get_config().keys())


def test_quick_config_is_small_and_valid():
  c = _load("quick")
  train.validate_config(c)
  assert (c.task, c.model) == ("marked_reversal", "ns")
  assert c.train_max_length <= 30 and c.num_train_batches <= 500


@pytest.mark.parametrize("field,value,message", [
    ("task", "palindromes", "config.task"),
    ("model", "gru", "config.model"),
    ("num_states", 0, "config.num_states must be >= 1"),
    ("num_stack_symbols", 0, "config.num_stack_symbols"),
    ("hidden_size", -3, "config.hidden_size"),
    ("learning_rate", -0.1, "config.learning_rate must be finite and > 0"),
    ("learning_rate", float("nan"), "config.learning_rate must be finite"),
    ("adam_eps", float("inf"), "config.adam_eps must be finite and > 0"),
    ("lr_decay_threshold", float("nan"),
     "config.lr_decay_threshold must be finite and >= 0"),
    ("lr_decay_threshold", float("inf"), "config.lr_decay_threshold"),
    ("adam_b2", float("nan"), "config.adam_b2 must be in [0, 1)"),
    ("param_seed", 2 ** 64 + 1, "config.param_seed must be < 2**32"),
    ("shuffle_seed", 2 ** 32, "config.shuffle_seed must be < 2**32"),
    ("clip_norm", 0.0, "config.clip_norm"),
    ("lr_decay_factor", 1.5, "config.lr_decay_factor"),
    ("train_min_length", 90, "config.train_min_length (90) is greater"),
    ("test_min_length", 101, "config.test_min_length"),
    ("compile_strategy", "pad", "config.compile_strategy"),
    ("dtype", "int8", "config.dtype"),
    ("checkpoints_to_keep", 1, "config.checkpoints_to_keep"),
    ("batch_size", 0, "config.batch_size"),
    ("data_seed", -1, "config.data_seed"),
    ("scan_unroll", -1, "config.scan_unroll must be 0 (automatic) or a "
     "positive integer"),
    ("ns_action_init", "glorot", "config.ns_action_init is 'glorot'; "
     "expected one of uniform, xavier"),
])
def test_validation_errors_name_the_field(field, value, message):
  config = default.get_config()
  config[field] = value
  with pytest.raises(ValueError) as info:
    train.validate_config(config)
  assert message in str(info.value)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [dict(model="vrns"),
                                       dict(model="rns", stack_window=4)])
def test_scan_unroll_is_refused_where_the_scans_are_not_unrolled(overrides):
  config = default.get_config()
  config.update(overrides)
  config.scan_unroll = 4
  with pytest.raises(ValueError, match="config.scan_unroll must be 1 for "
                     "model"):
    train.validate_config(config)


@pytest.mark.parametrize("overrides,message", [
    (dict(model="lstm"), "not to model 'lstm', table 'shares'"),
    (dict(model="jm"), "not to model 'jm', table 'shares'"),
    (dict(stack_table="log"), "not to model 'ns', table 'log'"),
    (dict(model="vrns", broadcast_bottom_vector=True),
     "the run-consistent VRNS bottom"),
    (dict(model="rns", stack_window=4), None),
    (dict(model="vrns"), None),
])
def test_valid_stack_margin_needs_a_share_stack(overrides, message):
  config = default.get_config()
  config.valid_stack_margin = True
  config.update(overrides)
  if message is None:
    train.validate_config(config)
    return
  with pytest.raises(ValueError, match="config.valid_stack_margin ") as info:
    train.validate_config(config)
  assert message in str(info.value)


def test_xavier_action_init_is_the_ns_rnn_s_only():
  config = default.get_config()
  config.ns_action_init = "xavier"
  train.validate_config(config)          # model ns
  config.model = "rns"
  with pytest.raises(ValueError, match="config.ns_action_init applies to "
                     "model 'ns' only"):
    train.validate_config(config)


@pytest.mark.parametrize("overrides,message", [
    (dict(model="lstm", stack_table="log"),
     "config.stack_table is 'log', which model 'lstm' cannot run; leave it "
     "at 'shares'"),
    (dict(model="rns", stack_table="scaled"),
     "config.stack_table is 'scaled', which model 'rns' cannot run; leave "
     "it at 'shares' or use 'log'"),
    (dict(model="rns", stack_table="scaled", stack_window=4),
     "config.stack_table is 'scaled', which model 'rns' cannot run; leave "
     "it at 'shares' or use 'log'"),
    (dict(model="vrns", stack_table="scaled"),
     "config.stack_table is 'scaled', which model 'vrns' cannot run; leave "
     "it at 'shares' or use 'log'"),
])
def test_a_stack_table_the_model_cannot_run_is_refused(overrides, message):
  config = default.get_config()
  config.update(overrides)
  with pytest.raises(ValueError, match=re.escape(message)):
    train.validate_config(config)
  config.stack_table = "shares"
  train.validate_config(config)
  if config.model in ("rns", "vrns"):  # With or without a window.
    config.stack_table = "log"
    train.validate_config(config)


def test_buckets_must_cover_the_longest_string():
  config = default.get_config()
  config.compile_strategy = "bucket"
  config.length_buckets = (50, 80)
  with pytest.raises(ValueError, match="config.length_buckets"):
    train.validate_config(config)


def test_batch_must_divide_device_count(monkeypatch):
  monkeypatch.setattr(train.jax, "device_count", lambda: 4)
  config = default.get_config()  # batch 10
  with pytest.raises(ValueError, match="config.batch_size .10. is not "
                     "divisible by the number of devices .4."):
    train.validate_config(config)


def test_cli_override_and_one_line_error(tmp_path):
  # The override is applied (max_epochs=0 is then rejected) and the CLI
  # prints one line naming the field, without a traceback.
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.main", "--config=configs/quick.py",
       f"--workdir={tmp_path}", "--config.max_epochs=0",
       "--config.learning_rate=0.001"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "error: config.max_epochs must be >= 1 (got 0)" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("override,guesses", [
    ("--config.learning_rat=0.1", "learning_rate or learning_rate_grid"),
    # The field holding all the misspelt name's words comes first.
    ("--config.test_per_length=3",
     "test_strings_per_length or test_min_length or test_max_length"),
])
def test_cli_unknown_field_one_line_error(tmp_path, override, guesses):
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.main", "--config=configs/quick.py",
       f"--workdir={tmp_path}", override],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1
  name = override.split("=")[0][len("--config."):]
  assert lines[0] == (f"error: unknown config field '{name}'; did you mean "
                      f"{guesses}? (fields: configs/default.py)")


def test_no_test_module_changes_jax_flags_at_import():
  # Global flags belong in fixtures (tests/conftest.py), or one module's
  # setting leaks into every module collected after it.
  import ast  # pylint: disable=g-import-not-at-top
  offenders = []
  for path in glob.glob(os.path.join(REPO, "tests", "*.py")):
    tree = ast.parse(open(path).read())
    for node in tree.body:  # module level only
      call = node.value if isinstance(node, ast.Expr) else None
      if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
          and call.func.attr == "update"
          and "config" in ast.unparse(call.func.value)):
        offenders.append(f"{os.path.basename(path)}:{node.lineno}")
  assert not offenders


# The ICLR 2022 (Q, S) of the RNS-RNN per task (rns-vrns-reference.md §4.2).
RNS_QS = {"marked_reversal": (2, 3), "unmarked_reversal": (2, 3),
          "dyck": (2, 3), "padded_reversal": (3, 3), "hardest_cfl": (3, 3)}


@pytest.mark.parametrize("task", TASKS)
def test_rns_configs(task):
  config = _load(f"{task}_rns")
  train.validate_config(config)
  assert (config.task, config.model) == (task, "rns")
  assert (config.num_states, config.num_stack_symbols) == RNS_QS[task]
  assert (config.stack_normalize, config.stack_reading, config.stack_bottom,
          config.stack_window) == (False, "state", "fixed", 0)
  # EOS predicted, per-length test bound without ln N_L (both later tags).
  assert config.predict_eos and not config.test_bound_includes_num_lengths
  assert config.learning_rate in config.learning_rate_grid
  doc = importlib.import_module(f"configs.{task}_rns").__doc__
  assert f"--config=configs/{task}_rns.py" in doc


def test_quick_rns_config():
  config = _load("quick_rns")
  train.validate_config(config)
  assert config.model == "rns" and config.max_epochs == 45  # quick.py's


@pytest.mark.parametrize("field,value,message", [
    ("stack_window", -1, "config.stack_window"),
    ("stack_bottom", "sticky", "config.stack_bottom"),
    ("stack_reading", "vector", "config.stack_reading"),
    ("truncation_length", 8, "config.truncation_length needs"),
])
def test_bad_stack_variant_is_a_one_line_error(field, value, message):
  config = _load("quick_rns")
  config[field] = value
  with pytest.raises(ValueError, match=message) as info:
    train.validate_config(config)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,changes,message", [
    ("quick_vrns", {"truncation_length": 5},
     "config.truncation_length needs a memory-limited stack"),
    ("quick_vrns", {"stack_bottom": "frozen"},
     "config.stack_bottom is 'frozen': model 'vrns' has only"),
    ("quick", {"stack_window": 4}, "model 'ns' has no memory-limited stack"),
    ("quick", {"model": "lstm", "stack_window": 5},
     "model 'lstm' has no memory-limited stack"),
    ("quick", {"model": "jm", "stack_window": 3, "truncation_length": 2},
     "model 'jm' has no memory-limited stack"),
])
def test_stack_variant_a_model_would_ignore_is_refused(name, changes,
                                                       message):
  # Not silently dropped: an unlimited stack trained where a window was
  # asked for would be wrong numbers under the asked-for name.
  config = _load(name)
  train.validate_config(config)
  for field, value in changes.items():
    config[field] = value
  with pytest.raises(ValueError, match=message) as info:
    train.validate_config(config)
  assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match=message.replace("config.", "")):
    models.build(config)


@pytest.mark.parametrize("changes,message", [
    ({"model": "gref", "jm_num_stacks": 3},
     "config.jm_num_stacks applies to model 'jm' only (model is 'gref')"),
    ({"model": "ns", "jm_push_hidden_state": True},
     "config.jm_push_hidden_state applies to model 'jm' only"),
    ({"model": "jm", "jm_num_stacks": 0},
     "config.jm_num_stacks must be an integer >= 1 (got 0)"),
    ({"model": "jm", "jm_push_hidden_state": True, "stack_embedding_size": 3},
     "config.jm_push_hidden_state pushes the hidden state, so jm_num_stacks "
     "* stack_embedding_size must equal hidden_size (got 1 * 3 != 20)"),
])
def test_bad_jm_variant_is_a_one_line_error(changes, message):
  config = default.get_config()
  config.update(changes)
  with pytest.raises(ValueError) as info:
    train.validate_config(config)
  assert message in str(info.value)
  assert "\n" not in str(info.value)
  # The same fields where they apply are accepted.
  config = default.get_config()
  config.update(model="jm", jm_num_stacks=3, stack_embedding_size=3)
  train.validate_config(config)
  config.update(jm_num_stacks=4, stack_embedding_size=5,
                jm_push_hidden_state=True)
  train.validate_config(config)


@pytest.mark.parametrize("model,field,value", [
    ("ns", "stack_vector_size", 0), ("lstm", "stack_vector_size", 20),
    ("rns", "stack_bottom_vector", "bogus"),
    ("jm", "broadcast_bottom_vector", True)])
def test_a_vrns_field_set_for_another_model_is_refused(model, field, value):
  # It would be ignored: a run that looks like it used the value.
  config = default.get_config()
  config.model = model
  with config.unlocked():
    config[field] = value
  with pytest.raises(ValueError, match=(
      f"config.{field} is {re.escape(repr(value))} but applies to model "
      f"'vrns' only \\(model is '{model}'\\); leave it at")) as info:
    train.validate_config(config)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("task", ["dyck_k7", "marked_reversal_k3",
                                  "unmarked_reversal_k5", "marked_copy_k3",
                                  "count_and_copy_k4"])
def test_validation_accepts_every_task_languages_accepts(task):
  # Not in languages.ALL_TASKS, but languages.get builds them: validation
  # must agree (one source of truth).
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  assert task not in languages.ALL_TASKS
  languages.get(task)
  config = default.get_config()
  config.task = task
  train.validate_config(config)


@pytest.mark.parametrize("task,message", [
    ("dyck_k1", "config.task is invalid: task 'dyck_k1': alphabet size must "
     "be >= 2 (got 1)"),
    ("marked_reversal_k0", "alphabet size must be >= 2 (got 0)"),
    ("unmarked_copy_k1", "alphabet size must be >= 2 (got 1)"),
    ("count_3_k4", "count_3 has no alphabet size"),
    ("palindromes_k3", "unknown task 'palindromes_k3'"),
    ("dyck_kx", "unknown task 'dyck_kx'"),
])
def test_bad_task_is_a_one_line_error(task, message):
  config = default.get_config()
  config.task = task
  with pytest.raises(ValueError) as info:
    train.validate_config(config)
  assert message in str(info.value)
  assert "\n" not in str(info.value)


# --- configs/later.py: the later papers' tasks x models ---------------------

# The capacity study's models (rns-vrns-reference.md §4.3), Q-S-m.
LATER_MODELS = ("lstm", "jm-3", "jm-3.3.3", "jm-hidden", "rns-1-3",
                "rns-2-3", "vrns-1-1-3", "vrns-2-1-3", "vrns-2-3-3")
LATER_FIELDS = {
    "lstm": {"model": "lstm"},
    "jm-3": {"model": "jm", "stack_embedding_size": 3, "jm_num_stacks": 1,
             "jm_push_hidden_state": False},
    "jm-3.3.3": {"model": "jm", "stack_embedding_size": 3,
                 "jm_num_stacks": 3, "jm_push_hidden_state": False},
    "jm-hidden": {"model": "jm", "stack_embedding_size": 20,
                  "jm_num_stacks": 1, "jm_push_hidden_state": True},
    "rns-1-3": {"model": "rns", "num_states": 1, "num_stack_symbols": 3},
    "rns-2-3": {"model": "rns", "num_states": 2, "num_stack_symbols": 3},
    "vrns-1-1-3": {"model": "vrns", "num_states": 1, "num_stack_symbols": 1,
                   "stack_vector_size": 3},
    "vrns-2-1-3": {"model": "vrns", "num_states": 2, "num_stack_symbols": 1,
                   "stack_vector_size": 3},
    "vrns-2-3-3": {"model": "vrns", "num_states": 2, "num_stack_symbols": 3,
                   "stack_vector_size": 3},
}


# The ICLR 2022 context-free study's models (rns-vrns-reference.md §4.2):
# the variants keep the CoNLL 2020 (frozen) bottom.
ICLR2022_FIELDS = {
    "gref-20": {"model": "gref", "stack_embedding_size": 20,
                "compile_strategy": "bucket"},
    "ns-2-3": {"model": "rns", "num_states": 2, "num_stack_symbols": 3,
               "stack_normalize": True, "stack_reading": "symbol"},
    "ns+s-2-3": {"model": "rns", "stack_normalize": True,
                 "stack_reading": "state"},
    "ns+u-3-3": {"model": "rns", "num_states": 3, "num_stack_symbols": 3,
                 "stack_normalize": False, "stack_reading": "symbol"},
    "ns+s+u-2-3": {"model": "rns", "stack_normalize": False,
                   "stack_reading": "state"},
}


@pytest.mark.parametrize("spec", ICLR2022_FIELDS)
def test_later_iclr2022_models(spec):
  import jax  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  later = importlib.import_module("configs.later")
  config = _later(f"hardest_cfl,{spec}")
  train.validate_config(config)
  for field, value in ICLR2022_FIELDS[spec].items():
    assert config[field] == value, field
  if config.model == "rns":
    assert (config.stack_bottom, config.stack_window) == ("frozen", 0)
  assert config.predict_eos and not config.test_bound_includes_num_lengths
  params = models.init_params(models.build(config), jax.random.PRNGKey(0))
  assert params["output"]["kernel"].shape == (20, 8)  # 7 symbols + EOS
  # Each task's models: the baselines, then the variants at its (Q, S).
  assert later.iclr2022_models("dyck") == (
      "lstm", "jm-2", "jm-20", "jm-40", "gref-2", "gref-20", "gref-40",
      "ns-2-3", "ns+s-2-3", "ns+u-2-3", "ns+s+u-2-3")
  assert later.iclr2022_models("padded_reversal")[-1] == "ns+s+u-3-3"
  with pytest.raises(ValueError, match="runs no models on 'marked_copy'"):
    later.iclr2022_models("marked_copy")


def _later_tasks():
  from nsrnn_jax import tasks_ncf  # pylint: disable=g-import-not-at-top
  return tasks_ncf.NCF_TASKS + tuple(
      f"{f}_k40" for f in tasks_ncf.CAPACITY_FAMILIES)


def _later(arg):
  return importlib.import_module("configs.later").get_config(arg)


@pytest.mark.parametrize("task", _later_tasks())
@pytest.mark.parametrize("spec", LATER_MODELS)
def test_later_config_validates_and_initialises(task, spec):
  import jax  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import languages  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  config = _later(f"{task},{spec}")
  train.validate_config(config)
  assert config.task == task
  # EOS predicted, per-length test bound without ln N_L (both later tags).
  assert config.predict_eos and not config.test_bound_includes_num_lengths
  for field, value in LATER_FIELDS[spec].items():
    assert config[field] == value, field
  if config.model == "rns":
    assert (config.stack_normalize, config.stack_reading, config.stack_bottom,
            config.stack_window) == (False, "state", "fixed", 0)
  if config.model == "vrns":
    assert config.stack_bottom_vector == "learned"
    assert not config.broadcast_bottom_vector
  # Protocol fields (§4.1, §4.3) are configs/default.py's, unchanged.
  base = default.get_config()
  for field in ("batch_size", "num_train_batches", "num_valid_batches",
                "clip_norm", "max_epochs", "lr_decay_factor",
                "lr_decay_patience", "early_stopping_patience",
                "train_min_length", "train_max_length", "test_min_length",
                "test_max_length", "test_strings_per_length", "hidden_size"):
    assert config[field] == base[field], field
  assert 5e-4 <= config.learning_rate <= 1e-2
  lang = languages.get(task)
  assert lang.valid_lengths(40, 80) and lang.valid_lengths(40, 100)
  params = models.init_params(models.build(config), jax.random.PRNGKey(0))
  assert params["output"]["kernel"].shape == (20, lang.vocab_size + 1)  # EOS


def test_later_jm_hidden_width_override_does_not_change_the_hidden_size():
  # The width derives from the hidden size; setting the width alone breaks
  # the link (it does not shrink the controller) and fails validation.
  config = _later("marked_copy,jm-hidden")
  config.stack_embedding_size = 10
  assert config.hidden_size == 20
  with pytest.raises(ValueError, match=r"\(got 1 \* 10 != 20\)"):
    train.validate_config(config)


def test_later_jm_hidden_follows_a_hidden_size_override():
  # The pushed hidden state sets the stack's width: an override of the
  # hidden size (applied after get_config, as --config.hidden_size is)
  # resizes the stack, and the model builds with it.
  import jax  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  config = _later("marked_copy,jm-hidden")
  config.hidden_size = 12
  assert config.stack_embedding_size == 12
  train.validate_config(config)
  params = models.init_params(models.build(config), jax.random.PRNGKey(0))
  assert params["controller"]["w_hh"].shape == (12, 48)
  assert "push" not in params


@pytest.mark.parametrize("spec", LATER_MODELS)
def test_later_models_run_a_short_batch(spec):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from nsrnn_jax import models  # pylint: disable=g-import-not-at-top
  config = _later(f"dyck_k40,{spec}")  # the largest vocabulary here (80)
  model = models.build(config)
  params = models.init_params(model, jax.random.PRNGKey(0))
  symbols = jnp.asarray([[0, 2, 3, 1, 78], [4, 5, 79, 78, 0]], jnp.int32)
  logits = np.asarray(model.apply({"params": params}, symbols))
  assert logits.shape == (2, 5, 81)  # 80 symbols + EOS
  assert np.all(np.isfinite(logits))
  # Row t reads symbols[:t]: the first row is the output bias, and changing
  # symbol 3 (s -> 79 - s) changes row 4 only.
  np.testing.assert_array_equal(
      logits[:, 0], np.broadcast_to(params["output"]["bias"], (2, 81)))
  other = symbols.at[:, 3].set(79 - symbols[:, 3])
  logits_other = np.asarray(model.apply({"params": params}, other))
  np.testing.assert_array_equal(logits_other[:, :4], logits[:, :4])
  assert np.all(np.abs(logits_other[:, 4] - logits[:, 4]).max(-1) > 1e-6)


@pytest.mark.parametrize("arg,message", [
    (None, "configs/later.py needs ':<task>,<model>'"),
    ("marked_copy", "configs/later.py needs ':<task>,<model>'"),
    ("marked_copy,lstm,jm-3", "configs/later.py needs"),
    ("marked_cop,lstm", "unknown task 'marked_cop'; valid tasks: count_3,"),
    ("dyck_k1,lstm", "alphabet size must be >= 2 (got 1)"),
    ("count_3_k4,lstm", "count_3 has no alphabet size"),
    ("dyck_k40,gru", "unknown model 'gru'; valid: lstm, jm-<m>, "
     "jm-<m>.<m>[.<m>...] (equal widths), jm-hidden, rns-<Q>-<S>, "
     "vrns-<Q>-<S>-<m>, gref-<m>, ns-<Q>-<S>, ns+s-<Q>-<S>"),
    ("dyck_k40,jm-3.4", "unknown model 'jm-3.4'"),
    ("dyck_k40,jm-3.0.3", "unknown model 'jm-3.0.3'"),
    ("dyck_k40,jm-3.", "unknown model 'jm-3.'"),
    ("dyck_k40,jm-hidden-20", "unknown model 'jm-hidden-20'"),
    ("dyck_k40,jm-03", "unknown model 'jm-03'"),   # one spelling per size
    ("dyck_k40,rns-02-3", "unknown model 'rns-02-3'"),
    ("dyck_k40,rns-2", "unknown model 'rns-2'"),
    ("dyck_k40,vrns-2-0-3", "unknown model 'vrns-2-0-3'"),
    ("dyck_k40,jm-0", "unknown model 'jm-0'"),
    ("dyck,ns+u+s-2-3", "unknown model 'ns+u+s-2-3'"),  # one spelling
    ("dyck,ns-2", "unknown model 'ns-2'"),
    ("dyck,gref-0", "unknown model 'gref-0'"),
])
def test_later_bad_argument_is_a_one_line_error(arg, message):
  with pytest.raises(ValueError) as info:
    _later(arg)
  assert message in str(info.value)
  assert "\n" not in str(info.value)


def test_later_docstring_gives_the_command():
  doc = importlib.import_module("configs.later").__doc__
  assert "--config=configs/later.py:marked_copy,vrns-2-1-3" in doc
  assert "Expected:" in doc


@pytest.mark.parametrize("arg,expected", [
    # A good argument is parsed and the override applied (then rejected).
    ("marked_copy,vrns-2-1-3", "error: config.max_epochs must be >= 1"),
    ("dyck_k40,nope", "error: cannot load --config: configs/later.py: "
     "unknown model 'nope'"),
])
def test_later_cli_argument(tmp_path, arg, expected):
  proc = subprocess.run(
      [sys.executable, "-m", "nsrnn_jax.main",
       f"--config=configs/later.py:{arg}", f"--workdir={tmp_path}",
       "--config.max_epochs=0"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr
  assert "Traceback" not in proc.stderr


# --- corpus language modelling (task "corpus") ------------------------------


@pytest.mark.parametrize("name, model", [("ptb_lstm", "lstm"),
                                         ("ptb_rns", "rns"),
                                         ("ptb_vrns", "vrns")])
def test_ptb_configs_have_the_reference_protocol(name, model, tmp_path):
  config = _load(name)
  # validate_config wants a directory with the three split files.
  for split in ("train", "valid", "test"):
    (tmp_path / f"{split}.txt").write_text("a b\n")
  config.corpus_dir = str(tmp_path)
  train.validate_config(config)
  assert (config.task, config.model) == ("corpus", model)
  # rns-vrns-reference.md §4.4.
  assert (config.batch_size, config.bptt_length, config.hidden_size) == (
      32, 35, 256)
  assert config.optimizer == "sgd" and config.init_scale == 0.05
  assert config.input_lookup  # 10k words: gather, not a one-hot product
  assert 1 <= config.learning_rate <= 100
  assert 0.0112 <= config.clip_norm <= 1.12
  assert config.lr_decay_factor == pytest.approx(1 / 1.5)
  assert (config.lr_decay_patience, config.lr_decay_threshold,
          config.early_stopping_patience, config.max_epochs) == (0, 0, 1, 100)
  if model != "lstm":
    assert config.stack_window == 35 and config.truncation_length == 0
  doc = importlib.import_module(f"configs.{name}").__doc__
  assert f"--config=configs/{name}.py" in doc


@pytest.mark.parametrize("field,value", [
    ("init_scale", 0.1), ("init_scale", -1.0), ("eval_batch_size", -5),
    ("bptt_length", 0), ("corpus_dir", "/nonexistent")])
def test_corpus_fields_on_a_formal_language_task_are_refused(field, value):
  # They apply to task "corpus" only: set elsewhere they were ignored.
  config = _load("quick")
  train.validate_config(config)
  config[field] = value
  with pytest.raises(ValueError, match=re.escape(
      f"config.{field} is {value!r} but applies to task 'corpus' only "
      "(task 'marked_reversal'); leave it at ")):
    train.validate_config(config)
  assert set(train.CORPUS_FIELD_DEFAULTS) <= set(_load("default").keys())
  for f, value in train.CORPUS_FIELD_DEFAULTS.items():
    assert _load("default")[f] == value, f
