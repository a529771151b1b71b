"""The paper's Figures 3 and 4 as numbers, read from its LaTeX source.

The CoNLL 2020 paper's LaTeX source draws Figures 3 (validation CE
difference per epoch) and 4 (test CE difference per length) with pgfplots,
and carries each panel's data: per model a mean line
(`\\addplot [lineK] table {x y ...}`; line0-3 = LSTM, Gref, JM, Ours in every
panel, which the legend entries confirm where a panel has them) and a
shaded band drawn as a closed path (`\\path [fill=colorK] (axis cs:x,y)
--...--cycle;`: matplotlib's fill_between polygon, the lower edge forward and
the upper edge back). The band is mean ± std over the five restarts (the
paper's captions), so std = (upper − lower) / 2 at each x.

`parse(tex)` turns the concatenated source (one `%% file: figures/<kind>-<task>.tex`
marker before each figure file, as in `../shared/paper/`) into

  {"train" | "test": {task: {model: {"x": [...], "mean": [...], "std": [...]}}}}

with tasks named as in `languages.TASKS` and models as in the configs (lstm,
gref, jm, ns). `results/paper_figures.json` is that dict as committed, made
by

  python -m nsrnn_jax.paper_figures --tex=../shared/paper/nsrnn-dusell-chiang-2020.tex.txt \\
      --out=results/paper_figures.json

and `reproduce --report` draws its means as dashed lines in our figures.
The source lacks the training figures of unmarked and padded reversal.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Any, Mapping, Optional, Sequence

FORMAT = "nsrnn_jax.paper_figures.v1"
# The committed data, beside the run records (repository root/results).
DEFAULT_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
    "paper_figures.json")

# Legend entries of the paper's figures -> our model names, in the order of
# their line styles (line0-line3) in every panel.
MODELS = {"LSTM": "lstm", "Gref": "gref", "JM": "jm", "Ours": "ns"}
_LINE_LABELS = tuple(MODELS)
# File names of the paper's figure files -> our task names.
TASKS = {"marked-reversal": "marked_reversal",
         "unmarked-reversal": "unmarked_reversal",
         "padded-reversal": "padded_reversal", "dyck": "dyck",
         "hardest-cfl": "hardest_cfl"}

_FILE = re.compile(r"^%% file: figures/(train|test)-([a-z-]+)\.tex\s*$",
                   re.MULTILINE)
_ANY_FILE = re.compile(r"^%% file: ", re.MULTILINE)
_BAND = re.compile(r"\\path \[[^\]]*fill=color(\d+)[^\]]*\]\s*(.*?)--cycle;",
                   re.DOTALL)
_POINT = re.compile(r"\(axis cs:([-+0-9.eE]+),([-+0-9.eE]+)\)")
_LINE = re.compile(r"\\addplot \[line(\d+)\]\s*table \{%?\s*(.*?)\}",
                   re.DOTALL)
_LEGEND = re.compile(r"\\addlegendentry\{([^}]*)\}")


class PaperFiguresError(ValueError):
  """The LaTeX source or the JSON file is not what this module reads."""


def _band(points: Sequence[tuple[float, float]]
          ) -> dict[float, tuple[float, float]]:
  """{x: (centre, half height)} of a fill_between polygon.

  The polygon visits every x on its lower and on its upper edge, so the
  least and greatest y at an x are the two edges.
  """
  low, high = {}, {}
  for x, y in points:
    low[x] = min(y, low.get(x, y))
    high[x] = max(y, high.get(x, y))
  return {x: ((high[x] + low[x]) / 2, (high[x] - low[x]) / 2) for x in low}


def _panel(body: str, where: str) -> dict[str, dict[str, list[float]]]:
  """{model: {"x", "mean", "std"}} of one figure file's text."""
  bands = {}
  for color, path in _BAND.findall(body):
    try:
      points = [(float(x), float(y)) for x, y in _POINT.findall(path)]
    except ValueError as e:
      raise PaperFiguresError(f"{where}: unreadable band color{color} "
                              f"({e})") from e
    bands[int(color)] = _band(points)
  out = {}
  lines = list(_LINE.finditer(body))
  for i, match in enumerate(lines):
    index, table = match.groups()
    # Its legend entry, if any, comes before the next line's \addplot.
    rest = body[match.end():lines[i + 1].start() if i + 1 < len(lines)
                else len(body)]
    legend = _LEGEND.search(rest)
    legend = legend.group(1) if legend else None
    if int(index) >= len(_LINE_LABELS):
      raise PaperFiguresError(f"{where}: unknown line style line{index}")
    label = _LINE_LABELS[int(index)]
    if legend and legend != label:
      raise PaperFiguresError(f"{where}: line{index} is {label} in every "
                              f"panel, but its legend entry says {legend!r}")
    rows = [line.split() for line in table.strip().splitlines()]
    try:
      xs = [float(r[0]) for r in rows]
      means = [float(r[1]) for r in rows]
    except (IndexError, ValueError) as e:
      raise PaperFiguresError(f"{where}: unreadable table of {label}") from e
    band = bands.get(int(index))
    if band is None or set(band) != set(xs):
      raise PaperFiguresError(
          f"{where}: the band of {label} (color{index}) does not cover the "
          "line's x values")
    # mean ± std: the band is centred on the line (to rounding) or it is
    # not this line's band.
    if any(abs(band[x][0] - m) > 1e-9 * (1 + abs(m))
           for x, m in zip(xs, means)):
      raise PaperFiguresError(
          f"{where}: the band color{index} is not centred on the line of "
          f"{label}")
    out[MODELS[label]] = {"x": xs, "mean": means,
                          "std": [band[x][1] for x in xs]}
  if not out:
    raise PaperFiguresError(f"{where}: no \\addplot line with a legend entry")
  return out


def parse(tex: str) -> dict[str, dict[str, Any]]:
  """The figures' data of the paper's concatenated LaTeX source.

  Args:
    tex: the source, each figure file preceded by its line
      `%% file: figures/<train|test>-<task>.tex`.

  Returns:
    {"train": {task: panel}, "test": {task: panel}}, panel = {model: {"x":
    epochs or lengths, "mean": ..., "std": ...}} (lists of floats).

  Raises:
    PaperFiguresError: no figure file, an unknown task or line style, a
      legend entry that contradicts the line styles' order, or a line whose
      band does not cover it.
  """
  out = {"train": {}, "test": {}}
  markers = list(_FILE.finditer(tex))
  if not markers:
    raise PaperFiguresError("no '%% file: figures/<train|test>-<task>.tex' "
                            "marker in the LaTeX source")
  for marker in markers:
    kind, name = marker.groups()
    if name not in TASKS:
      raise PaperFiguresError(f"figures/{kind}-{name}.tex: unknown task")
    following = _ANY_FILE.search(tex, marker.end())
    body = tex[marker.end():following.start() if following else len(tex)]
    out[kind][TASKS[name]] = _panel(body, f"figures/{kind}-{name}.tex")
  return out


def load(path: str = DEFAULT_PATH) -> Optional[dict[str, dict[str, Any]]]:
  """The committed figure data ({"train", "test"}), or None if absent."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:   # ValueError: JSON, UTF-8
    raise PaperFiguresError(f"unreadable {path}: {e}") from e
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise PaperFiguresError(f"{path} is not a {FORMAT} file")
  for kind in ("train", "test"):
    for task, model, problem in _curve_problems(data.get(kind)):
      raise PaperFiguresError(f"{path}: {kind}/{task}/{model} {problem}")
  return {"train": data["train"], "test": data["test"]}


def _curve_problems(panels):
  """(task, model, what is wrong) of each curve of one kind that is not
  {"x", "mean", "std"}: lists of finite numbers of one length."""
  if not isinstance(panels, dict):
    yield "-", "-", "is missing or not an object"
    return
  for task, panel in panels.items():
    if not isinstance(panel, dict):
      yield task, "-", "is not an object"
      continue
    for model, c in panel.items():
      lists = [c.get(k) for k in ("x", "mean", "std")] if isinstance(
          c, dict) else [None]
      if not all(isinstance(v, list) for v in lists):
        yield task, model, "lacks the lists x, mean and std"
      elif len({len(v) for v in lists}) != 1:
        yield task, model, "has lists x, mean and std of different lengths"
      elif not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) for v in sum(lists, [])):
        yield task, model, "holds a value that is not a finite number"


def curve(data: Optional[Mapping[str, Any]], kind: str, task: str,
          model: str) -> Optional[Mapping[str, list[float]]]:
  """One model's {"x", "mean", "std"}, or None where the paper has none."""
  if data is None:
    return None
  return data.get(kind, {}).get(task, {}).get(model)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`python -m nsrnn_jax.paper_figures`; returns the exit status."""
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  parser = cli.OneLineArgumentParser(
      prog="python -m nsrnn_jax.paper_figures",
      description="Write the paper's Figure 3/4 data (from its LaTeX "
      "source) as JSON.")
  parser.add_argument("--tex", required=True,
                      help="the paper's concatenated LaTeX source")
  parser.add_argument("--out", default=DEFAULT_PATH, help="JSON to write")
  args = parser.parse_args(argv)
  try:
    with open(args.tex, encoding="utf-8") as f:
      data = parse(f.read())
  except UnicodeDecodeError as e:
    print(f"error: {args.tex} is not UTF-8 text ({e.reason} at byte "
          f"{e.start})", file=sys.stderr)
    return 2
  except (OSError, PaperFiguresError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  data = {"format": FORMAT,
          "source": "DuSell & Chiang (2020), the pgfplots data of Figures 3 "
                    "and 4 in the paper's LaTeX source; std = half the shaded "
                    "band's height",
          **data}
  try:
    with open(args.out, "w") as f:
      json.dump(data, f, sort_keys=True)
      f.write("\n")
  except OSError as e:
    print(f"error: --out: {e}", file=sys.stderr)
    return 2
  panels = sum(len(v) for k, v in data.items() if k in ("train", "test"))
  print(f"wrote {args.out}: {panels} panels")
  return 0


if __name__ == "__main__":
  from nsrnn_jax import cli  # pylint: disable=g-import-not-at-top
  cli.run_argparse_command(main)
