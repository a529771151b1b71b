"""benchmarks/machine.py: the op count (the ops a compiled program runs)
and `save_rows`, the result JSON every benchmark writes.

Oracles: a hand-written HLO module whose count follows from its text (a
while loop, a call and a conditional nested in it), and real compiled scans
whose counts must scale exactly with their trip counts.
"""

import jax
import jax.numpy as jnp
import pytest

# Entry: 2 ops of its own (the add fusion, the while), the while's 3 trips
# of body (a dot and a call of a computation with 2 ops, a conditional whose
# larger branch has 2 ops) and condition (1 compare). Parameters, tuples,
# get-tuple-element, bitcasts and constants run no code. The while's tuple
# shape holds an `/*index=5*/` comment and a nested tuple, as XLA prints.
_HLO = """\
HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%callee (p.0: f32[4]) -> f32[4] {
  %p.0 = f32[4]{0} parameter(0)
  %neg = f32[4]{0} negate(%p.0)
  ROOT %abs = f32[4]{0} abs(%neg)
}

%small (q.0: f32[4]) -> f32[4] {
  ROOT %q.0 = f32[4]{0} parameter(0)
}

%big (r.0: f32[4]) -> f32[4] {
  %r.0 = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%r.0)
  ROOT %l = f32[4]{0} log(%e)
}

%body (t.0: (s32[], f32[4], (f32[4], f32[4]), f32[4], f32[4], f32[4])) -> (s32[], f32[4], (f32[4], f32[4]), f32[4], f32[4], f32[4]) {
  %t.0 = (s32[], f32[4]{0}, (f32[4]{0}, f32[4]{0}), f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t.0), index=0
  %x = f32[4]{0} get-tuple-element(%t.0), index=1
  %d = f32[4]{0} dot(%x, %x), lhs_contracting_dims={}, rhs_contracting_dims={}
  %c = f32[4]{0} call(%d), to_apply=%callee
  %pred = pred[] constant(true)
  %k = f32[4]{0} conditional(%pred, %c, %c), true_computation=%small, false_computation=%big
  %b = f32[1,4]{1,0} bitcast(%k)
  ROOT %out = (s32[], f32[4]{0}, (f32[4]{0}, f32[4]{0}), f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) tuple(%i, %k, %t.0, %k, %k, %k)
}

%cond (u.0: (s32[], f32[4], (f32[4], f32[4]), f32[4], f32[4], f32[4])) -> pred[] {
  %u.0 = (s32[], f32[4]{0}, (f32[4]{0}, f32[4]{0}), f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element(%u.0), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}

ENTRY %main (a.0: f32[4]) -> f32[4] {
  %a.0 = f32[4]{0} parameter(0)
  %added = f32[4]{0} fusion(%a.0), kind=kLoop, calls=%callee
  %init = (s32[], f32[4]{0}, (f32[4]{0}, f32[4]{0}), f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) tuple(%added)
  %loop = (s32[], f32[4]{0}, (f32[4]{0}, f32[4]{0}), f32[4]{0}, f32[4]{0}, /*index=5*/f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %res = f32[4]{0} get-tuple-element(%loop), index=1
}
"""


def test_counts_a_hand_written_module(load_benchmark):
  machine = load_benchmark("machine")
  # Body: dot 1 + call 2 + conditional (1 + max(0, 2)) = 6; condition 1.
  assert machine.sequential_ops(_HLO) == 1 + 1 + 3 * (6 + 1)


def test_a_loop_without_a_known_trip_count_is_an_error(load_benchmark):
  machine = load_benchmark("machine")
  unknown = _HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}',
                         "")
  with pytest.raises(ValueError, match="known trip count"):
    machine.sequential_ops(unknown)
  with pytest.raises(ValueError, match="no ENTRY computation"):
    machine.sequential_ops(_HLO.replace("ENTRY %main", "%main"))


def test_compiled_scans_count_each_trip(load_benchmark):
  machine = load_benchmark("machine")

  def count(length):
    def body(x, _):
      return jnp.cumsum(jnp.sin(x), axis=0), None
    f = jax.jit(lambda x: jax.lax.scan(body, x, None, length=length)[0])
    return machine.sequential_ops(
        f.lower(jnp.ones((3, 2))).compile().as_text())

  # Same body, so the difference is exactly the extra trips' ops.
  per_trip = count(7) - count(6)
  assert per_trip >= 1
  assert count(12) - count(6) == 6 * per_trip


def test_a_data_dependent_loop_has_no_count(load_benchmark):
  machine = load_benchmark("machine")
  f = jax.jit(lambda x: jax.lax.while_loop(lambda v: v.sum() < 100.0,
                                           lambda v: v * 2.0, x))
  with pytest.raises(ValueError, match="known trip count"):
    machine.sequential_ops(f.lower(jnp.ones(3)).compile().as_text())


def test_save_rows_writes_the_machine_note_fields_and_rows(load_benchmark,
                                                            tmp_path):
  # What every benchmark's JSON holds: the machine's description, the
  # device label, float32 unless given, the note (with the run's own note
  # appended), the benchmark's fields and its rows, at `out` when given.
  import json  # pylint: disable=g-import-not-at-top
  machine = load_benchmark("machine")
  out = tmp_path / "sub" / "x.json"
  note = machine.with_note("interleaved", "background paused")
  assert note == "interleaved; background paused"
  assert machine.with_note("interleaved") == "interleaved"
  assert machine.with_note("", "paused") == "paused"
  got = machine.save_rows("ignored.json", [{"a": 1}], note, out=str(out),
                          reps=3, dtype="float64")
  assert json.loads(out.read_text()) == got
  assert got["rows"] == [{"a": 1}] and got["reps"] == 3
  assert got["note"] == note and got["dtype"] == "float64"
  assert got["backend"] == jax.default_backend()
  assert got["device"] == machine.device_label(got)


def test_a_revision_without_the_module_is_one_line_exit_2(load_benchmark,
                                                          capsys):
  machine = load_benchmark("machine")
  if machine.source_revision() is not None:   # a git checkout
    # A revision that exists loads its module (a timing's before side).
    old = machine.module_at_revision("HEAD", "limited_stack")
    assert callable(old.run_coupled)
  with pytest.raises(SystemExit) as exit_info:
    machine.module_at_revision("no-such-revision-x", "limited_stack")
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(
      "error: no nsrnn_jax/limited_stack.py at git revision "
      "'no-such-revision-x'"), err


def test_a_revision_git_lacks_is_read_from_baselines(load_benchmark,
                                                     tmp_path, monkeypatch):
  # A device machine gets a copied tree without git history: the before side
  # of a timing comes from .baselines/<rev>/ (benchmarks/gpu_session.sh).
  machine = load_benchmark("machine")
  monkeypatch.setattr(machine, "REPO", str(tmp_path))
  copy = tmp_path / ".baselines" / "abc1234" / "nsrnn_jax"
  copy.mkdir(parents=True)
  (copy / "toy.py").write_text("VALUE = 41 + 1\n")
  module = machine.module_at_revision("abc1234", "toy")
  assert module.VALUE == 42 and module.__file__ == "abc1234:nsrnn_jax/toy.py"
  assert machine.file_at_revision("abc1234", "nsrnn_jax/toy.py") == (
      "VALUE = 41 + 1\n", None)
  text, reason = machine.file_at_revision("abc1234", "nsrnn_jax/other.py")
  assert text is None and reason   # git's (or the OS's) own words
