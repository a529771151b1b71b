"""Tests for nsrnn_jax/inspection.py.

Oracles (none of them shares code with the module under test):
  * the true next-symbol distribution: brute-force enumeration of every
    string of a short length, scored by `languages` (its own inside
    algorithm), and for a toy grammar a top-down enumeration of derivations;
  * stack posteriors: explicit PDA configurations (state, whole stack) under
    the frozen-bottom semantics, merged per step;
  * Viterbi: a hard-weight PDA simulated step by step; the Viterbi run must be
    exactly the run that PDA takes.
"""

import itertools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsrnn_jax import inspection
from nsrnn_jax import languages
from nsrnn_jax import limited_stack
from nsrnn_jax import models
from nsrnn_jax import pcfg
from nsrnn_jax import rns_stack

# ---------------------------------------------------------------------------
# Helpers (oracles)
# ---------------------------------------------------------------------------


def random_actions(rng, num_t, q, s, scale=2.0):
  """Random per-(q, x) action distributions [T,Q,S,Q,S]x2 and [T,Q,S,Q]."""
  logits = rng.normal(size=(num_t, q, s, 2 * q * s + q)) * scale
  p = np.exp(logits)
  p /= p.sum(-1, keepdims=True)
  return (p[..., :q * s].reshape(num_t, q, s, q, s),
          p[..., q * s:2 * q * s].reshape(num_t, q, s, q, s),
          p[..., 2 * q * s:])


def explicit_configurations(push, repl, pop):
  """{(state, stack): probability} after each update, by explicit stacks."""
  num_t, q, s = push.shape[:3]
  configs = [{(0, (0,)): 1.0}]
  for t in range(num_t):
    nxt = {}
    for (state, stack), w in configs[-1].items():
      x = stack[-1]
      moves = []
      for r in range(q):
        for y in range(s):
          moves.append((r, stack + (y,), push[t, state, x, r, y]))
          if len(stack) > 1:  # the bottom is never replaced
            moves.append((r, stack[:-1] + (y,), repl[t, state, x, r, y]))
        if len(stack) > 2:  # the symbol on the bottom is never popped
          moves.append((r, stack[:-1], pop[t, state, x, r]))
      for r, new_stack, p in moves:
        nxt[(r, new_stack)] = nxt.get((r, new_stack), 0.0) + w * p
    configs.append(nxt)
  return configs


def simulate_hard_pda(rng, num_t, q, s, confidence):
  """A PDA whose every (t, q, x) row puts `confidence` on one action.

  The action of the configuration actually visited at time t is drawn among
  the moves the frozen-bottom semantics allows; every other row gets an
  arbitrary preferred action. Returns the weights and the run it takes as
  (op, new_state, symbol, stack_after) per update.
  """
  num_actions = 2 * q * s + q
  p = np.full((num_t, q, s, num_actions),
              (1.0 - confidence) / (num_actions - 1))
  state, stack, run = 0, [0], []
  for t in range(num_t):
    for qq in range(q):
      for x in range(s):
        p[t, qq, x, rng.integers(num_actions)] = confidence
    p[t, state] = (1.0 - confidence) / (num_actions - 1)
    allowed = ["push"] + (["replace"] if len(stack) > 1 else []) + (
        ["pop"] if len(stack) > 2 else [])
    # Favour pops and pushes so that runs nest (exercises the pop term).
    op = rng.choice(allowed, p=None if len(allowed) == 1 else
                    np.array([3, 1, 3][:len(allowed)]) / sum(
                        [3, 1, 3][:len(allowed)]))
    r = int(rng.integers(q))
    x = stack[-1]
    if op == "push":
      y = int(rng.integers(s))
      column = r * s + y
      stack.append(y)
    elif op == "replace":
      y = int(rng.integers(s))
      column = q * s + r * s + y
      stack[-1] = y
    else:
      y = None
      column = 2 * q * s + r
      stack.pop()
    p[t, state, x, column] = confidence
    run.append((str(op), r, y, tuple(stack)))
    state = r
  push = p[..., :q * s].reshape(num_t, q, s, q, s)
  repl = p[..., q * s:2 * q * s].reshape(num_t, q, s, q, s)
  return push, repl, p[..., 2 * q * s:], run


def brute_force_next_symbol(lang, symbols, first_row=0):
  """p(w_{t+1} | w_<=t, n) by scoring every completion of w_<=t with ln G.

  Rows before `first_row` are left NaN (their completions are too many to
  score quickly for the hardest CFL).
  """
  n, v = len(symbols), lang.vocab_size
  out = np.full((n, v), np.nan)
  for t in range(first_row, n):
    tails = np.array(list(itertools.product(range(v), repeat=n - t)))
    strings = np.concatenate(
        [np.tile(np.asarray(symbols[:t], np.int64), (len(tails), 1)), tails],
        axis=1)
    g = np.exp(lang.log_prob_batch(strings))
    out[t] = [g[tails[:, 0] == a].sum() for a in range(v)]
    out[t] /= out[t].sum()
  return out


# ---------------------------------------------------------------------------
# True next-symbol distribution
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("task,length,first_row", [
    ("marked_reversal", 9, 0), ("unmarked_reversal", 8, 0),
    ("padded_reversal", 7, 0), ("dyck", 6, 0), ("hardest_cfl", 6, 2)])
def test_true_next_symbol_matches_brute_force(task, length, first_row):
  lang = languages.get(task)
  symbols = lang.sample(length, np.random.default_rng(3))
  probs = inspection.true_next_symbol_distribution(
      inspection.task_grammar(task), symbols)
  expected = brute_force_next_symbol(lang, symbols, first_row)
  np.testing.assert_allclose(probs[first_row:], expected[first_row:],
                             rtol=1e-10, atol=1e-13)
  np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("task,length", [
    ("count_3", 6), ("marked_copy", 7), ("unmarked_copy", 6),
    ("unmarked_copy_different_alphabets", 6), ("marked_reverse_and_copy", 8),
    ("unmarked_reverse_and_copy", 6), ("count_and_copy", 6),
    ("marked_copy_k3", 5)])
def test_true_next_symbol_of_uniform_tasks_matches_brute_force(task, length):
  # The non-context-free tasks have no grammar: task_grammar gives the task,
  # whose strings are uniform given the length. Oracle: every completion of
  # each prefix scored with ln G, for a sampled string and for one whose
  # prefix leaves the language (NaN rows exactly where no string of this
  # length continues the prefix).
  lang = languages.get(task)
  grammar = inspection.task_grammar(task)
  symbols = list(lang.sample(length, np.random.default_rng(4)))
  bad = list(symbols)
  bad[length - 2] = (bad[length - 2] + 1) % lang.vocab_size
  for string in (symbols, bad):
    probs = inspection.true_next_symbol_distribution(grammar, string)
    for t in range(length):
      tails = np.array(list(itertools.product(range(lang.vocab_size),
                                              repeat=length - t)))
      strings = np.concatenate(
          [np.tile(np.asarray(string[:t], np.int64), (len(tails), 1)),
           tails], axis=1)
      g = np.exp(lang.log_prob_batch(strings))
      totals = np.array([g[tails[:, 0] == a].sum()
                         for a in range(lang.vocab_size)])
      if totals.sum() == 0:
        assert np.all(np.isnan(probs[t])), (string, t)
      else:
        np.testing.assert_allclose(probs[t], totals / totals.sum(),
                                   rtol=1e-12, atol=1e-15)
  assert np.isnan(probs[-1]).all()  # the changed symbol leaves the language
  # A length no string has: every row NaN.
  assert np.isnan(inspection.true_next_symbol_distribution(
      grammar, symbols + [0])).all()


def test_true_next_symbol_marked_reversal_closed_form():
  # Length 9: the first four symbols are free (1/2 each), then # is forced,
  # then the mirror image is forced.
  lang = languages.get("marked_reversal")
  symbols = lang.encode("0110#0110")
  probs = inspection.true_next_symbol_distribution(
      inspection.task_grammar("marked_reversal"), symbols)
  expected = np.zeros((9, 3))
  expected[:4, :2] = 0.5
  expected[4, 2] = 1.0
  expected[np.arange(5, 9), [0, 1, 1, 0]] = 1.0
  np.testing.assert_allclose(probs, expected, atol=1e-15)


def test_true_next_symbol_toy_ambiguous_grammar_by_derivations():
  # S -> S S / .4 | a / .35 | b / .25. Enumerate derivations top-down: each
  # string of length n has the same number of derivations (Catalan), so the
  # conditional of every position is .35 / .6 for a.
  grammar = pcfg.CompiledPCFG(pcfg.PCFG(
      "S", [("S", ["S", "S"], 0.4), ("S", [0], 0.35), ("S", [1], 0.25)], 2))
  probs = inspection.true_next_symbol_distribution(grammar, [0, 1, 1, 0, 1])

  def derivation_weights(n):
    """{string: weight} of all leftmost derivations with n leaves."""
    out = {}
    forms = [(("S",), 1.0)]
    while forms:
      form, w = forms.pop()
      if len(form) > n:
        continue
      if "S" not in form:
        if len(form) == n:
          out[form] = out.get(form, 0.0) + w
        continue
      i = form.index("S")
      for rhs, p in ((("S", "S"), 0.4), (("a",), 0.35), (("b",), 0.25)):
        forms.append((form[:i] + rhs + form[i + 1:], w * p))
    return out

  weights = derivation_weights(5)
  string = ("a", "b", "b", "a", "b")
  for pos in range(5):
    num = {a: sum(w for s, w in weights.items()
                  if s[:pos] == string[:pos] and s[pos] == a)
           for a in "ab"}
    np.testing.assert_allclose(probs[pos],
                               [num["a"] / (num["a"] + num["b"]),
                                num["b"] / (num["a"] + num["b"])], rtol=1e-12)


def test_impossible_prefix_gives_nan_rows():
  grammar = inspection.task_grammar("marked_reversal")
  probs = inspection.true_next_symbol_distribution(grammar, [2, 0, 0])
  # "#" first: only length 1 is possible, so no row after it has mass.
  assert np.all(np.isnan(probs[1:]))
  np.testing.assert_allclose(probs[0], [0.5, 0.5, 0.0])


# ---------------------------------------------------------------------------
# Stack posteriors and Viterbi
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_t,q,s", [(5, 2, 2), (4, 3, 2), (4, 2, 3)])
def test_stack_posteriors_match_explicit_configurations(num_t, q, s):
  push, repl, pop = random_actions(np.random.default_rng(num_t * q * s),
                                   num_t, q, s)
  out = inspection.stack_posteriors(push, repl, pop)
  for t, configs in enumerate(explicit_configurations(push, repl, pop)):
    alpha = np.zeros((q, s))
    for (state, stack), w in configs.items():
      alpha[state, stack[-1]] += w
    np.testing.assert_allclose(np.exp(out["log_mass_T1"][t]), alpha.sum(),
                               rtol=1e-12)
    np.testing.assert_allclose(out["posterior_T1xQxS"][t],
                               alpha / alpha.sum(), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(out["readings_T1xS"][t],
                               alpha.sum(0) / alpha.sum(), rtol=1e-10,
                               atol=1e-14)


@pytest.mark.parametrize("confidence", [0.9, 1.0])
@pytest.mark.parametrize("seed,q,s", [(0, 2, 2), (1, 2, 3), (2, 3, 2)])
def test_viterbi_is_the_run_a_hard_weight_pda_takes(seed, q, s, confidence):
  num_t = 16
  push, repl, pop, run = simulate_hard_pda(np.random.default_rng(seed), num_t,
                                           q, s, confidence)
  assert any(op == "pop" for op, *_ in run)  # the pop term is exercised
  result = inspection.viterbi_run(push, repl, pop)
  got = [(op.op, op.new_state, op.symbol, op.stack) for op in result.ops]
  assert got == run
  assert result.log_prob == pytest.approx(num_t * math.log(confidence),
                                          abs=1e-6)
  # The run's ops chain: each starts where the previous ended.
  state, top = 0, 0
  for op in result.ops:
    assert (op.state, op.top) == (state, top)
    state, top = op.new_state, op.stack[-1]
  table = result.table()
  assert len(table.splitlines()) == num_t + 1
  assert "pop" in table and "⊥" in table


def test_viterbi_matches_exhaustive_search():
  rng = np.random.default_rng(7)
  push, repl, pop = random_actions(rng, 5, 2, 2, scale=3.0)
  # Exhaustive: best run weight among all explicit runs.
  best_w, best_ops = -1.0, None
  runs = [((), 0, (0,), 1.0)]
  for t in range(5):
    nxt = []
    for ops, state, stack, w in runs:
      x = stack[-1]
      for r in range(2):
        for y in range(2):
          nxt.append((ops + (("push", r, y),), r, stack + (y,),
                      w * push[t, state, x, r, y]))
          if len(stack) > 1:
            nxt.append((ops + (("replace", r, y),), r, stack[:-1] + (y,),
                        w * repl[t, state, x, r, y]))
        if len(stack) > 2:
          nxt.append((ops + (("pop", r, None),), r, stack[:-1],
                      w * pop[t, state, x, r]))
    runs = nxt
  for ops, _, _, w in runs:
    if w > best_w:
      best_w, best_ops = w, ops
  result = inspection.viterbi_run(push, repl, pop)
  assert [(o.op, o.new_state, o.symbol) for o in result.ops] == list(best_ops)
  assert result.log_prob == pytest.approx(math.log(best_w), rel=1e-6)


def test_action_probabilities_rows_and_posterior_marginal():
  push, repl, pop = random_actions(np.random.default_rng(5), 6, 2, 3)
  out = inspection.action_probabilities(push, repl, pop)
  np.testing.assert_allclose(out["rows_TxQxSx3"].sum(-1), 1.0, rtol=1e-12)
  # Naive loop for the marginal; update 1 sees only (q0, bottom).
  post = out["posterior_T1xQxS"]
  np.testing.assert_allclose(post[0], [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
  for t in range(6):
    for o, name in enumerate(("push", "repl", "pop")):
      total = 0.0
      for q in range(2):
        for x in range(3):
          row = {"push": push, "repl": repl, "pop": pop}[name][t, q, x]
          total += post[t, q, x] * row.sum()
      assert out["marginal_3xT"][o, t] == pytest.approx(total, rel=1e-12)
  np.testing.assert_allclose(out["marginal_3xT"][:, 0],
                             out["rows_TxQxSx3"][0, 0, 0])


# ---------------------------------------------------------------------------
# A real (randomly initialised) NS-RNN
# ---------------------------------------------------------------------------


@pytest.fixture(name="ns_model", scope="module")
def fixture_ns_model():
  model = models.get("ns", vocab_size=3, hidden_size=8, num_states=2,
                     num_stack_symbols=2)
  params = model.init(jax.random.key(0), np.zeros((1, 9), np.int32))["params"]
  # Sharpen the action layer so the stack is far from uniform.
  params = dict(params)
  params["action"] = {k: v * 30.0 for k, v in params["action"].items()}
  return model, params


def test_inspect_string_agrees_with_model_and_ns_stack(ns_model):
  model, params = ns_model
  lang = languages.get("marked_reversal")
  symbols = lang.encode("0110#0110")
  insp = inspection.inspect_string(model, params, symbols,
                                   inspection.task_grammar("marked_reversal"),
                                   lang.alphabet)
  logits = np.asarray(model.apply({"params": params},
                                  np.asarray(symbols, np.int32)[None]))[0]
  expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(insp.model_probs_NxV, expected, rtol=2e-5)
  # The model's readings (ns_stack, float32) equal our float64 replay of
  # Lang's algorithm on the traced actions.
  np.testing.assert_allclose(insp.readings_SxN.T,
                             insp.actions["readings_T1xS"], atol=2e-5)
  assert insp.readings_SxN.shape == (2, 9)
  np.testing.assert_allclose(insp.readings_SxN[:, 0], [1.0, 0.0])
  assert len(insp.viterbi.ops) == 8 and insp.viterbi.probabilities
  assert insp.viterbi.summary() == (
      f"run probability {np.exp(insp.viterbi.log_prob):.4g}")
  np.testing.assert_allclose(insp.true_probs_NxV[4], [0.0, 0.0, 1.0])
  np.testing.assert_allclose(insp.model_nll_N,
                             -np.log(expected[np.arange(9), symbols]),
                             rtol=2e-5)
  # The text views print the same numbers (3 decimals).
  lines = insp.next_symbol_table().splitlines()
  assert len(lines) == 10 and lines[5].split()[:2] == ["5", "#"]
  printed = np.array([float(x) for x in lines[5].split()[2:]])
  np.testing.assert_allclose(printed[0::2], expected[4], atol=5e-4)
  np.testing.assert_allclose(printed[1::2], [0.0, 0.0, 1.0], atol=5e-4)
  printed_nll = float(insp.summary().split("=")[1].split()[0])
  assert printed_nll == pytest.approx(
      -np.log(expected[np.arange(9), symbols]).sum(), abs=2e-4)
  # The share stack's margin: the model's own, in the summary line.
  want = float(model.apply({"params": params},
                           np.asarray(symbols, np.int32)[None],
                           method="stack_margin")[0])
  assert insp.stack_margin == pytest.approx(want, rel=1e-6) and want < 0
  assert insp.exact_margin == pytest.approx(-40.21, abs=0.01)
  verdict = ("(proven exact)" if want > insp.exact_margin
             else "(not proven exact")
  assert f"stack margin {want:.1f} nats {verdict}" in insp.summary()


def test_inspect_string_on_a_non_context_free_task(ns_model):
  # marked_copy has the NS-RNN fixture's vocabulary (0, 1, #): the true
  # next-symbol distribution of its uniform strings, u # u.
  model, params = ns_model
  lang = languages.get("marked_copy")
  insp = inspection.inspect_string(model, params, lang.encode("011#011"),
                                   inspection.task_grammar("marked_copy"),
                                   lang.alphabet)
  expected = np.zeros((7, 3))
  expected[:3, :2] = 0.5
  expected[3, 2] = 1.0
  expected[np.arange(4, 7), [0, 1, 1]] = 1.0
  np.testing.assert_allclose(insp.true_probs_NxV, expected)
  assert insp.true_nll_N.sum() == pytest.approx(3 * np.log(2))


def test_a_string_given_as_text_is_inspected_as_its_ids(ns_model):
  model, params = ns_model
  lang = languages.get("marked_reversal")
  by_ids = inspection.inspect_string(model, params, lang.encode("01#10"),
                                     alphabet=lang.alphabet)
  for text in ("01#10", "0 1 # 1 0", ["0", "1", "#", "1", "0"]):
    by_text = inspection.inspect_string(model, params, text,
                                        alphabet=lang.alphabet)
    np.testing.assert_array_equal(by_text.symbols, by_ids.symbols)
    np.testing.assert_array_equal(by_text.model_probs_NxV,
                                  by_ids.model_probs_NxV)
  with pytest.raises(ValueError, match="pass alphabet="):
    inspection.inspect_string(model, params, "01#10")
  with pytest.raises(ValueError, match=r"\['x'\] are not in the alphabet"):
    inspection.inspect_string(model, params, "01#x0", alphabet=lang.alphabet)


def test_figures_show_the_inspected_numbers(ns_model):
  model, params = ns_model
  lang = languages.get("marked_reversal")
  symbols = lang.encode("01#10")
  insp = inspection.inspect_string(model, params, symbols,
                                   inspection.task_grammar("marked_reversal"),
                                   lang.alphabet)
  fig = inspection.plot_actions(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(),
                             insp.actions["marginal_3xT"])
  fig = inspection.plot_readings(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(),
                             insp.readings_SxN)
  fig = inspection.plot_next_symbol(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(),
                             insp.model_probs_NxV.T)
  np.testing.assert_allclose(fig.axes[1].images[0].get_array(),
                             insp.true_probs_NxV.T)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def test_bad_input_is_rejected_with_clear_errors(ns_model):
  model, params = ns_model
  push, repl, pop = random_actions(np.random.default_rng(0), 3, 2, 2)
  with pytest.raises(ValueError, match="probabilities, not log"):
    inspection.stack_posteriors(np.log(push), repl, pop)
  with pytest.raises(ValueError, match="do not agree"):
    inspection.viterbi_run(push, repl, pop[:, :, :, :1])
  with pytest.raises(ValueError, match="one string"):
    inspection.stack_posteriors(push[None], repl[None], pop[None])
  grammar = inspection.task_grammar("marked_reversal")
  with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
    inspection.true_next_symbol_distribution(grammar, [0, 3, 0])
  with pytest.raises(ValueError, match="empty"):
    inspection.true_next_symbol_distribution(grammar, [])
  with pytest.raises(ValueError, match="vocabulary"):
    inspection.inspect_string(model, params, [0, 1],
                              inspection.task_grammar("dyck"))
  lstm = models.get("lstm", vocab_size=3, hidden_size=4)
  lstm_params = lstm.init(jax.random.key(0), np.zeros((1, 3), np.int32))
  insp = inspection.inspect_string(lstm, lstm_params["params"], [0, 2, 0])
  assert insp.actions is None and insp.viterbi is None
  assert insp.stack_margin is None and "margin" not in insp.summary()
  with pytest.raises(ValueError, match="NS-RNN"):
    inspection.plot_actions(insp)


# ---------------------------------------------------------------------------
# The RNS-RNN (model 'rns'): state readings and Viterbi
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bottom,window", [("fixed", 0), ("frozen", 3)])
def test_inspect_rns_string(bottom, window):
  import pda_oracle  # pylint: disable=g-import-not-at-top
  model = models.get("rns", vocab_size=3, hidden_size=8, num_states=2,
                     num_stack_symbols=2, stack_bottom=bottom,
                     stack_window=window)
  params = dict(models.init_params(model, jax.random.key(1)))
  params["action"] = {k: v * 30.0 for k, v in params["action"].items()}
  lang = languages.get("marked_reversal")
  symbols = lang.encode("01#10")
  insp = inspection.inspect_string(model, params, symbols)
  traced = inspection.trace(model, params, symbols)
  acts = [traced["action_log_weights"][k] for k in ("push", "repl", "pop")]
  # State readings: the brute-force PDA's (state, top) distribution.
  want, _ = pda_oracle.state_readings(*acts, bottom=bottom,
                                      window=window or None)
  np.testing.assert_allclose(insp.state_readings_QSxN.T, want, atol=2e-5)
  np.testing.assert_allclose(insp.readings_SxN,
                             want.reshape(5, 2, 2).sum(1).T, atol=2e-5)
  # Viterbi: the best run of the oracle, valid under the model's bottom.
  best = max(pda_oracle.configurations(*acts, "max", bottom,
                                       window or None)[-1].values())
  assert insp.viterbi.log_prob == pytest.approx(best, abs=1e-9)
  assert len(insp.viterbi.ops) == 4 and "push" in insp.viterbi.table()
  # Unnormalised weights are called weights, not probabilities.
  assert not insp.viterbi.probabilities
  assert insp.viterbi.table().splitlines()[0].split()[3] == "weight"
  assert insp.viterbi.summary().startswith(
      f"run weight {np.exp(best):.4g} (unnormalised")
  # The actions view: the model's own bottom and window (the brute-force
  # check of run_action_shares is below).
  want_shares = inspection.run_action_shares(*acts, bottom, window or None)
  # The margin of the stack run on the traced actions (float32, as the
  # model), proven exact here; with 30 times sharper weights not.
  f32 = [jnp.asarray(a, jnp.float32)[None] for a in acts]
  margin = (limited_stack.share_margin(*f32, window, bottom) if window
            else rns_stack.share_margin(*f32, bottom=bottom))
  assert insp.stack_margin == pytest.approx(float(margin[0]), rel=1e-5)
  assert insp.exact_margin < insp.stack_margin < 0
  assert f"stack margin {insp.stack_margin:.1f} nats (proven exact)" in (
      insp.summary())
  sharp = dict(params, action={k: v * 30.0
                               for k, v in params["action"].items()})
  insp_sharp = inspection.inspect_string(model, sharp, symbols)
  assert insp_sharp.stack_margin < insp.exact_margin
  assert ("(not proven exact: below -40.2; the 'log' table cannot flush)"
          in insp_sharp.summary())
  for key in ("rows_TxQxSx3", "marginal_3xT"):
    np.testing.assert_allclose(insp.actions[key], want_shares[key])
  fig = inspection.plot_actions(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(),
                             insp.actions["marginal_3xT"])
  assert fig.axes[0].get_title().startswith("share of the runs")
  fig = inspection.plot_readings(insp)
  images = [ax.images[0].get_array() for ax in fig.axes if ax.images]
  np.testing.assert_allclose(images[0], insp.readings_SxN)
  np.testing.assert_allclose(images[1], insp.state_readings_QSxN)


@pytest.mark.parametrize("bottom,window", [("fixed", None), ("frozen", None),
                                           ("fixed", 2), ("frozen", 3)])
def test_run_action_shares_match_explicit_runs(bottom, window):
  import pda_oracle  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(7)
  num_t, q, s = 5, 2, 2
  acts = [rng.normal(size=(num_t, q, s, q, s)) * 1.5,
          rng.normal(size=(num_t, q, s, q, s)) * 1.5,
          rng.normal(size=(num_t, q, s, q)) * 1.5 + 1.0]
  acts[1][1, 0, 0] = -np.inf  # impossible actions are allowed
  out = inspection.run_action_shares(*acts, bottom, window)
  for t in range(1, num_t + 1):
    # Explicit stacks: Σα_t of the runs whose update t is op, over Σα_t.
    prefix = [a[:t] for a in acts]
    log_z = pda_oracle.readings_and_log_mass(*prefix, bottom=bottom,
                                             window=window)[1][t]
    for op in range(3):
      only_op = [a.copy() for a in prefix]
      for other in {0, 1, 2} - {op}:
        only_op[other][t - 1] = -np.inf
      log_w = pda_oracle.readings_and_log_mass(*only_op, bottom=bottom,
                                               window=window)[1][t]
      assert out["marginal_3xT"][op, t - 1] == pytest.approx(
          np.exp(log_w - log_z), abs=1e-12)
  if bottom == "frozen":  # ⊥ alone on the stack: only a push is possible
    np.testing.assert_allclose(out["marginal_3xT"][:, 0], [1, 0, 0])
  # Each row's operation shares, written out.
  w = [np.exp(acts[0][2, 1, 0]).sum(), np.exp(acts[1][2, 1, 0]).sum(),
       np.exp(acts[2][2, 1, 0]).sum()]
  np.testing.assert_allclose(out["rows_TxQxSx3"][2, 1, 0],
                             np.array(w) / sum(w), rtol=1e-12)
  with pytest.raises(ValueError, match="do not agree"):
    inspection.run_action_shares(acts[0], acts[1], acts[2][..., :1])


def test_run_action_shares_after_every_run_died_are_zero_without_warning():
  """Pops alone at update 1 leave no run once the only ⊥ is popped (the
  fixed bottom's): updates 2.. have no share, and no NaN warning."""
  num_t, q, s = 3, 2, 2
  push = np.full((num_t, q, s, q, s), -np.inf)
  pop = np.zeros((num_t, q, s, q))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = inspection.run_action_shares(push, push.copy(), pop, "frozen")
  np.testing.assert_array_equal(out["marginal_3xT"], np.zeros((3, num_t)))
  np.testing.assert_array_equal(out["rows_TxQxSx3"][..., 2], 1.0)


# ---------------------------------------------------------------------------
# The VRNS-RNN (model 'vrns'): vector readings, action posteriors, Viterbi
# ---------------------------------------------------------------------------


def _vector_runs(push, repl, pop, vectors, bottom):
  """Every explicit run of the vector PDA (bottom fix), not merged.

  Yields (weight, ops, stacks) with ops[t-1] the kind of update t and
  stacks[j] the stack (tuple of (symbol, vector index)) after j updates;
  vector index 0 is v_⊥, p the vector pushed by update p.
  """
  num_t, q, s = push.shape[:3]

  def extend(j, state, stack, weight, ops, stacks):
    if j > num_t:
      yield weight, ops, stacks
      return
    x, vid = stack[-1]
    for r in range(q):
      for y in range(s):
        nxt = stack + ((y, j),)
        yield from extend(j + 1, r, nxt, weight * push[j - 1, state, x, r, y],
                          ops + ("push",), stacks + (nxt,))
        nxt = stack[:-1] + ((y, vid),)
        yield from extend(j + 1, r, nxt, weight * repl[j - 1, state, x, r, y],
                          ops + ("replace",), stacks + (nxt,))
      if len(stack) >= 2:
        nxt = stack[:-1]
        yield from extend(j + 1, r, nxt, weight * pop[j - 1, state, x, r],
                          ops + ("pop",), stacks + (nxt,))

  start = ((0, 0),)
  yield from extend(1, 0, start, 1.0, (), (start,))


def _vector_inputs(seed, num_t=3, q=2, s=2, m=2):
  rng = np.random.default_rng(seed)
  log_push = rng.normal(size=(num_t, q, s, q, s)) * 1.5
  log_repl = rng.normal(size=(num_t, q, s, q, s)) * 1.5
  log_pop = rng.normal(size=(num_t, q, s, q)) * 1.5
  log_repl[1, 0, 0] = -np.inf  # impossible actions are allowed
  vectors = 1 / (1 + np.exp(-rng.normal(size=(num_t, m))))
  bottom = 1 / (1 + np.exp(-rng.normal(size=(m,))))
  return log_push, log_repl, log_pop, vectors, bottom


@pytest.mark.parametrize("seed", [0, 1])
def test_vector_stack_view_matches_explicit_runs(seed):
  log_push, log_repl, log_pop, vectors, bottom = _vector_inputs(seed)
  num_t = log_push.shape[0]
  view = inspection.vector_stack_view(log_push, log_repl, log_pop, vectors,
                                      bottom)
  vec = np.concatenate([bottom[None], vectors])
  runs = list(_vector_runs(np.exp(log_push), np.exp(log_repl),
                           np.exp(log_pop), vectors, bottom))
  for j in range(num_t + 1):
    # Every run of j updates, and per (state, top) its weight and vector.
    sub = list(_vector_runs(np.exp(log_push[:j]), np.exp(log_repl[:j]),
                            np.exp(log_pop[:j]), vectors[:j], bottom))
    z = sum(w for w, _, _ in sub)
    p, rho = _state_top_and_reading(log_push[:j], log_repl[:j], log_pop[:j],
                                    vec)
    assert p.sum() == pytest.approx(z, rel=1e-12)
    np.testing.assert_allclose(view["state_top_T1xQxS"][j], p / z,
                               rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(view["readings_T1xQxSxM"][j], rho / z,
                               rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(view["expected_top_T1xM"][j],
                               rho.sum((0, 1)) / z, rtol=1e-10)
    assert view["log_mass_T1"][j] == pytest.approx(np.log(z), abs=1e-10)
    if j == 0:
      continue
    # Posterior of update j's operation among the runs of j updates.
    share = {op: sum(w for w, ops, _ in sub if ops[-1] == op) / z
             for op in inspection.OPS}
    np.testing.assert_allclose(view["marginal_3xT"][:, j - 1],
                               [share[op] for op in inspection.OPS],
                               atol=1e-12)
  # Local action shares per (q, x), written out.
  t, qq, x = 1, 1, 0
  weights = [np.exp(log_push[t, qq, x]).sum(), np.exp(log_repl[t, qq, x]).sum(),
             np.exp(log_pop[t, qq, x]).sum()]
  np.testing.assert_allclose(view["rows_TxQxSx3"][t, qq, x],
                             np.array(weights) / sum(weights), rtol=1e-12)
  # The best run and the vector on its top after each update.
  best_w, best_ops, best_stacks = max(runs, key=lambda r: r[0])
  run, tops = inspection.vrns_viterbi_run(log_push, log_repl, log_pop,
                                          vectors, bottom)
  assert run.log_prob == pytest.approx(np.log(best_w), abs=1e-10)
  assert tuple(op.op for op in run.ops) == best_ops
  np.testing.assert_allclose(tops, [vec[st[-1][1]] for st in best_stacks])


def _state_top_and_reading(log_push, log_repl, log_pop, vec):
  """Unnormalised Σ_runs w 𝟙(state, top) and Σ_runs w 𝟙(state, top) vec(top)
  by explicit enumeration of (state, stack-with-vector-ids) runs."""
  num_t, q, s = log_push.shape[:3]
  m = vec.shape[1]
  p = np.zeros((q, s))
  rho = np.zeros((q, s, m))

  def extend(j, state, stack, weight):
    if j > num_t:
      y, vid = stack[-1]
      p[state, y] += weight
      rho[state, y] += weight * vec[vid]
      return
    x, vid = stack[-1]
    for r in range(q):
      for y in range(s):
        extend(j + 1, r, stack + ((y, j),),
               weight * np.exp(log_push[j - 1, state, x, r, y]))
        extend(j + 1, r, stack[:-1] + ((y, vid),),
               weight * np.exp(log_repl[j - 1, state, x, r, y]))
      if len(stack) >= 2:
        extend(j + 1, r, stack[:-1],
               weight * np.exp(log_pop[j - 1, state, x, r]))

  extend(1, 0, ((0, 0),), 1.0)
  return p, rho


def test_inspect_vrns_string():
  model = models.get("vrns", vocab_size=3, hidden_size=8, num_states=2,
                     num_stack_symbols=2, stack_vector_size=2)
  params = dict(models.init_params(model, jax.random.key(2)))
  params["action"] = {k: v * 20.0 for k, v in params["action"].items()}
  params["push_vector"] = {k: v * 20.0
                           for k, v in params["push_vector"].items()}
  lang = languages.get("marked_reversal")
  symbols = lang.encode("01#10")
  insp = inspection.inspect_string(model, params, symbols, alphabet=(
      lang.alphabet))
  traced = inspection.trace(model, params, symbols)
  acts = [traced["action_log_weights"][k] for k in ("push", "repl", "pop")]
  vec = np.concatenate([traced["bottom_vector"][None],
                        traced["push_vectors"]])
  view = insp.vector_view
  # The float64 recomputation agrees with the enumeration and with what
  # the controller read (float32).
  for j in range(5):
    p, rho = _state_top_and_reading(*(a[:j] for a in acts), vec)
    z = p.sum()
    np.testing.assert_allclose(view["readings_T1xQxSxM"][j], rho / z,
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(insp.state_readings_QSxN[:, j],
                               (p / z).ravel(), atol=1e-12)
  np.testing.assert_allclose(view["traced_readings_T1xQxSxM"],
                             view["readings_T1xQxSxM"], atol=2e-5)
  np.testing.assert_allclose(insp.readings_SxN.sum(0), 1.0, atol=1e-12)
  np.testing.assert_allclose(insp.actions["marginal_3xT"].sum(0), 1.0,
                             atol=1e-12)
  assert len(insp.viterbi.ops) == 4
  assert view["viterbi_top_vectors_T1xM"].shape == (5, 2)
  fig = inspection.plot_vector_readings(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(),
                             view["expected_top_T1xM"].T)
  np.testing.assert_allclose(fig.axes[2].images[0].get_array(),
                             view["readings_T1xQxSxM"].reshape(5, -1).T)
  fig = inspection.plot_actions(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(),
                             insp.actions["marginal_3xT"])
  with pytest.raises(ValueError, match="VRNS-RNN"):
    inspection.plot_vector_readings(inspection.Inspection(
        insp.symbols, None, insp.model_probs_NxV))
  with pytest.raises(ValueError, match="push_vectors must be"):
    inspection.vector_stack_view(*acts, vec[1:, :1], vec[0])


def test_windowed_vector_stack_view_and_inspection():
  # The memory-limited VRNS: the float64 view and the Viterbi run follow the
  # window (explicit windowed runs), and inspecting a windowed model
  # recomputes what its controller read.
  import pda_oracle  # pylint: disable=g-import-not-at-top
  import vrns_oracle  # pylint: disable=g-import-not-at-top
  log_push, log_repl, log_pop, vectors, bottom = _vector_inputs(3, num_t=5)
  window = 2
  view = inspection.vector_stack_view(log_push, log_repl, log_pop, vectors,
                                      bottom, window=window)
  rho, log_mass = vrns_oracle.vector_readings(
      np.exp(log_push), np.exp(log_repl), np.exp(log_pop), vectors, bottom,
      window=window)
  np.testing.assert_allclose(view["readings_T1xQxSxM"], rho, rtol=1e-10,
                             atol=1e-13)
  np.testing.assert_allclose(view["log_mass_T1"], log_mass, atol=1e-10)
  log_alpha = pda_oracle.alpha(log_push, log_repl, log_pop, bottom="fixed",
                               window=window)
  np.testing.assert_allclose(
      view["state_top_T1xQxS"],
      np.exp(log_alpha - log_mass[:, None, None]), atol=1e-12)
  np.testing.assert_allclose(view["marginal_3xT"].sum(0), 1.0, atol=1e-12)
  unlimited = inspection.vector_stack_view(log_push, log_repl, log_pop,
                                           vectors, bottom)
  assert np.abs(unlimited["readings_T1xQxSxM"] - rho).max() > 1e-3
  best = pda_oracle.alpha(log_push, log_repl, log_pop, semiring="max",
                          bottom="fixed", window=window)[-1].max()
  run, tops = inspection.vrns_viterbi_run(log_push, log_repl, log_pop,
                                          vectors, bottom, window=window)
  assert run.log_prob == pytest.approx(best, abs=1e-10)
  assert tops.shape == (6, 2)

  model = models.get("vrns", vocab_size=3, hidden_size=8, num_states=2,
                     num_stack_symbols=2, stack_vector_size=2,
                     stack_window=2)
  params = dict(models.init_params(model, jax.random.key(2)))
  params["action"] = {k: v * 20.0 for k, v in params["action"].items()}
  params["push_vector"] = {k: v * 20.0
                           for k, v in params["push_vector"].items()}
  lang = languages.get("marked_reversal")
  insp = inspection.inspect_string(model, params, lang.encode("011#110"),
                                   alphabet=lang.alphabet)
  view = insp.vector_view
  np.testing.assert_allclose(view["traced_readings_T1xQxSxM"],
                             view["readings_T1xQxSxM"], atol=2e-5)


def test_inspect_eos_model_adds_an_eos_column():
  # A model trained with predict_eos has V + 1 outputs; the string's symbols
  # stay in [0, V) and the true next-symbol distribution (length given)
  # puts zero on EOS.
  lang = languages.get("marked_reversal")
  model = models.get("lstm", vocab_size=4, hidden_size=4)
  params = model.init(jax.random.key(0), np.zeros((1, 3), np.int32))["params"]
  symbols = lang.encode("01#10")
  grammar = inspection.task_grammar("marked_reversal")
  insp = inspection.inspect_string(model, params, symbols, grammar=grammar,
                                   alphabet=lang.alphabet, eos=True)
  assert insp.alphabet == (*lang.alphabet, "EOS")
  assert insp.model_probs_NxV.shape == (5, 4)
  np.testing.assert_allclose(insp.model_probs_NxV.sum(axis=1), 1.0, atol=1e-6)
  np.testing.assert_array_equal(insp.true_probs_NxV[:, 3], 0.0)
  np.testing.assert_allclose(
      insp.true_probs_NxV[:, :3],
      inspection.true_next_symbol_distribution(grammar, symbols))
  logits = np.asarray(inspection.trace(model, params, symbols)["logits"])
  want = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(insp.model_probs_NxV,
                             want / want.sum(-1, keepdims=True), atol=1e-6)
  assert "EOS" in insp.next_symbol_table()
  with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
    inspection.inspect_string(model, params, [0, 3], eos=True)
  with pytest.raises(ValueError, match="vocabulary"):
    inspection.inspect_string(model, params, symbols, grammar=grammar)


@pytest.mark.parametrize("name,extra", [
    ("jm", {}), ("jm", {"jm_num_stacks": 2}),
    ("jm", {"stack_embedding_size": 8, "jm_push_hidden_state": True}),
    ("gref", {})])
def test_inspect_jm_and_gref_string(name, extra):
  # The baselines' actions and readings, as the model traces them, with
  # labels per stack; the figure shows those numbers.
  kw = {"stack_embedding_size": 3, **extra}
  model = models.get(name, vocab_size=3, hidden_size=8, **kw)
  params = model.init(jax.random.key(1), np.zeros((1, 7), np.int32))["params"]
  lang = languages.get("marked_reversal")
  symbols = lang.encode("01#10")
  insp = inspection.inspect_string(model, params, symbols,
                                   inspection.task_grammar("marked_reversal"),
                                   lang.alphabet)
  traced = model.apply({"params": params}, np.asarray([symbols], np.int32),
                       method="trace")
  acts = np.asarray(traced["actions"][0], np.float64)
  values = insp.baseline_actions["values_RxT"]
  k = extra.get("jm_num_stacks", 1)
  if name == "gref":
    assert insp.baseline_actions["labels"] == list(inspection.GREF_OPS)
    np.testing.assert_allclose(values, acts.T)
  else:
    labels = insp.baseline_actions["labels"]
    assert len(labels) == 3 * k
    assert labels[:3] == (["stack 1 push", "stack 1 pop", "stack 1 no-op"]
                          if k > 1 else list(inspection.JM_OPS))
    np.testing.assert_allclose(values, acts.reshape(4, 3 * k).T)
    # Each stack's (push, pop, no-op) row group is a distribution.
    np.testing.assert_allclose(values.reshape(k, 3, 4).sum(1), 1.0,
                               rtol=1e-6)
  readings = np.asarray(traced["readings"][0], np.float64).T
  np.testing.assert_allclose(insp.baseline_readings_MxN, readings)
  assert insp.baseline_readings_MxN.shape == (
      kw["stack_embedding_size"] * k, 5)
  assert np.all(insp.baseline_readings_MxN[:, 0] == 0)   # r_0 = 0
  assert np.abs(insp.baseline_readings_MxN[:, 1:]).max() > 1e-3
  assert insp.actions is None and insp.readings_SxN is None
  fig = inspection.plot_superposition_stack(insp)
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(), values)
  np.testing.assert_allclose(fig.axes[1].images[0].get_array(), readings)
  # Nothing to show for the LSTM, or for a string of one symbol.
  lstm = models.get("lstm", vocab_size=3, hidden_size=8)
  lstm_params = lstm.init(jax.random.key(1),
                          np.zeros((1, 7), np.int32))["params"]
  for m, p, w in ((lstm, lstm_params, symbols), (model, params, symbols[:1])):
    with pytest.raises(ValueError, match="no JM or Gref stack actions"):
      inspection.plot_superposition_stack(inspection.inspect_string(m, p, w))


def test_the_grammar_may_be_given_as_a_name_or_a_task():
  # as_grammar: a name, languages.get(name) or task_grammar(name) give the
  # same distribution; anything else is a TypeError.
  symbols = [0, 1, 2, 1, 0]
  want = inspection.true_next_symbol_distribution(
      inspection.task_grammar("marked_reversal"), symbols)
  for grammar in ("marked_reversal", languages.get("marked_reversal")):
    np.testing.assert_array_equal(
        inspection.true_next_symbol_distribution(grammar, symbols), want)
  copy = inspection.true_next_symbol_distribution("marked_copy", [0, 2, 0])
  np.testing.assert_array_equal(copy, inspection.true_next_symbol_distribution(
      languages.get("marked_copy"), [0, 2, 0]))
  with pytest.raises(TypeError, match="grammar must be a task name"):
    inspection.true_next_symbol_distribution(None, symbols)


def test_a_window_that_is_no_positive_integer_is_refused():
  # 0 ran the unlimited stack, 2.7 a window of 2.
  rng = np.random.default_rng(3)
  acts = [rng.normal(size=(3, 2, 2, 2, 2)), rng.normal(size=(3, 2, 2, 2, 2)),
          rng.normal(size=(3, 2, 2, 2))]
  vectors, bottom = rng.uniform(size=(3, 2)), rng.uniform(size=2)
  for window in (0, 2.7, True, "2"):
    with pytest.raises(ValueError, match="window must be an integer D >= 1"):
      inspection.run_action_shares(*acts, "fixed", window)
    with pytest.raises(ValueError, match="window must be an integer D >= 1"):
      inspection.vector_stack_view(*acts, vectors, bottom, window=window)
