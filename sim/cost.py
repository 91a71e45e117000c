"""Profiles and the cost model: seconds for a prefill chunk, a decode round, a keep and a restore on one GPU.

A profile (JSON, format in sim/README.md) holds a model shape and cost terms in one of two
forms: "analytic" coefficients (derived from a model config and GPU ceilings by
bench/make_profiles.py) or a "table" of measured points (bench/profile.py on a GPU),
interpolated, optionally with the serving loop's own host seconds per step (`HostCost`).
Not here: the simulator's clock and scheduling (`sim.loop`).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from policy.shape import ModelShape
from policy.usable import BackendFacts

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "qwen3.5-9b-h200-roofline"
SOURCES = ("analytic", "measured")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(obj: dict[str, Any], key: str, where: str, *, lo: float = 0.0, hi: float = math.inf,
            integer: bool = False, open_lo: bool = False) -> Any:
    v = obj.get(key)
    ok = _is_number(v) and (not integer or isinstance(v, int))
    if not ok or not ((v > lo) if open_lo else (v >= lo)) or v > hi:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{where}{key}: must be {kind} in {'(' if open_lo else '['}{lo}, {hi}], got {v!r}")
    return v


def _keys(obj: Any, where: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where.rstrip('.') or 'profile'}: must be a JSON object, got {obj!r}")
    for key in required:
        if key not in obj:
            raise ValueError(f"{where}{key}: missing")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{where}{unknown[0]}: unknown key; known: {', '.join([*required, *optional])}")
    return obj


@attrs.frozen(kw_only=True)
class AnalyticCost:
    """Roofline coefficients; the formulas are in Profile's methods' docstrings.

    matrix_flops_per_s: peak bf16 matrix FLOP/s. matrix_efficiency: fraction of it reached, (0, 1].
    copy_bytes_per_s: device-memory bandwidth, bytes/s. weight_bytes: weights read per chunk or
    round (non-embedding + LM head). dense_flops_per_row: 2 x active non-embedding params.
    logits_flops_per_row: 2 x hidden x vocab (decode lanes). attention_flops_per_pair:
    4 x q_heads x head_dim x attention_layers, per (query row, key row). linear_flops_per_row:
    the chunked gated delta rule over every linear layer. chunk_overhead_s / round_overhead_s:
    fixed seconds added to every prefill chunk / decode round.
    """

    matrix_flops_per_s: float
    matrix_efficiency: float
    copy_bytes_per_s: float
    weight_bytes: int
    dense_flops_per_row: float
    logits_flops_per_row: float
    attention_flops_per_pair: float
    linear_flops_per_row: float
    chunk_overhead_s: float
    round_overhead_s: float

    def seconds(self, flops: float, nbytes: float) -> float:
        """max(flops / (peak x efficiency), bytes / bandwidth): the roofline."""
        return max(flops / (self.matrix_flops_per_s * self.matrix_efficiency), nbytes / self.copy_bytes_per_s)


@attrs.frozen(kw_only=True)
class Grid:
    """Measured seconds over a 2-D grid: seconds[i][j] at (x[i], y[j]), axes strictly ascending.

    `at(x, y)` interpolates bilinearly; below an axis's first point it holds the edge value;
    above the last y it extends each x row's last segment linearly, never below the value of
    a smaller x (a larger x can have the smaller slope); above the last x it scales the
    value at the last x by x / x_last (work grows with rows: a linear extension of the last
    x segment, whose slope can shrink as y grows, would make cost fall with context);
    never below 0. Non-decreasing in both axes when the table is.
    """

    x: tuple[float, ...]
    y: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def at(self, x: float, y: float) -> float:
        """Interpolated seconds at (x, y)."""
        if len(self.x) > 1 and x > self.x[-1]:
            return self.at(self.x[-1], y) * (x / self.x[-1])
        (i0, i1, wi), (j0, j1, wj) = _weights(self.x, x), _weights(self.y, y)
        s = self.seconds
        low = _lerp(s[i0][j0], s[i0][j1], wj)
        high = _lerp(s[i1][j0], s[i1][j1], wj)
        value = _lerp(low, high, wi)
        if wj > 1.0:  # past the last y each x row extends its own last segment, and a larger x
            for i in range(i0 + 1):  # can have the smaller slope: stay at or above every x row below
                value = max(value, _lerp(s[i][j0], s[i][j1], wj))
        return max(0.0, value)


@attrs.frozen(kw_only=True)
class Curve:
    """Measured seconds over one axis: seconds[i] at x[i] (bytes), x strictly ascending.

    `at(x)` interpolates linearly; below the first point it holds the first value, above
    the last it extends the last segment; never below 0.
    """

    x: tuple[float, ...]
    seconds: tuple[float, ...]

    def at(self, x: float) -> float:
        """Interpolated seconds at x."""
        i0, i1, w = _weights(self.x, x)
        return max(0.0, _lerp(self.seconds[i0], self.seconds[i1], w))


def _lerp(a: float, b: float, w: float) -> float:
    """a + w (b - a): exactly a when a == b (the form (1 - w) a + w b can miss it by an ulp,
    which made equal table rows look non-monotone), and non-decreasing in w when b >= a."""
    return a + w * (b - a)


def _weights(axis: tuple[float, ...], v: float) -> tuple[int, int, float]:
    if len(axis) == 1 or v <= axis[0]:
        return 0, 0, 0.0
    i = min(bisect.bisect_right(axis, v), len(axis) - 1)
    return i - 1, i, (v - axis[i - 1]) / (axis[i] - axis[i - 1])


@attrs.frozen(kw_only=True)
class HostCost:
    """The serving loop's own host seconds per step, beyond the backend calls (and each token's
    pick and detokenization) that the prefill and decode tables time: the scheduler's decide and
    commit, the runtime's hand-off to its worker thread and back, trace lines, events to the
    requests, the engine process's event batch over its pipe (measured by bench/host_cost.py).

    step_s: seconds added to every step (a decode round, a prefill chunk, or both in one step).
    lane_s: seconds added per decode lane (or restored lane) of a step, each round.
    chunk_s: seconds added to a step that runs a prefill chunk (on top of step_s).
    """

    step_s: float
    lane_s: float
    chunk_s: float

    def seconds(self, lanes: int, chunk: bool) -> float:
        """step_s + lanes x lane_s (+ chunk_s when the step runs a chunk), in seconds."""
        return self.step_s + lanes * self.lane_s + (self.chunk_s if chunk else 0.0)


@attrs.frozen(kw_only=True)
class TableCost:
    """Measured points: prefill seconds over (chunk rows, prior context rows); decode-round
    seconds over (lanes, mean context rows); keep (snapshot) and restore seconds over a kept
    state's bytes when measured, else bytes / copy_bytes_per_s; the serving loop's host
    seconds per step when measured (None: none charged)."""

    prefill: Grid
    decode: Grid
    copy_bytes_per_s: float
    keep: Curve | None = None
    restore: Curve | None = None
    host: HostCost | None = None


@attrs.frozen(kw_only=True)
class Profile:
    """A cost profile for one model on one GPU.

    name; source: "analytic" or "measured"; gpu; model (e.g. "Qwen/Qwen3.5-9B"); shape: the
    ModelShape that prices states; invariant_rows: the backend's proven invariant grid or None;
    cost: AnalyticCost or TableCost; notes: free text (where the numbers come from);
    provenance: (key, value) strings of a measurement (commit, command, date, backend, ...).
    """

    name: str
    source: str
    gpu: str
    model: str
    shape: ModelShape
    invariant_rows: int | None
    cost: AnalyticCost | TableCost
    notes: str = ""
    provenance: tuple[tuple[str, str], ...] = ()
    _row_bytes: int = attrs.field(init=False, repr=False, eq=False)
    _fixed_bytes: int = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_row_bytes", self.shape.row_bytes)
        object.__setattr__(self, "_fixed_bytes", self.shape.fixed_bytes)

    @property
    def facts(self) -> BackendFacts:
        """The backend facts the policy uses for this profile."""
        return BackendFacts(self.invariant_rows)

    def prefill_s(self, rows: int, context: int) -> float:
        """Seconds to prefill a chunk of `rows` rows whose first row has `context` rows before it.

        Analytic: max(F / (peak x eff), B / bw) + chunk_overhead_s with
          F = rows x (dense + linear flops per row) + pair flops x rows x (context + rows / 2),
          B = weight_bytes + (context + rows) x K/V row bytes + 2 x fixed state bytes (read, write).
        Table: the prefill grid at (rows, context).
        Raises ValueError: rows < 1 or context < 0.
        """
        if rows < 1 or context < 0:
            raise ValueError(f"prefill_s needs rows >= 1 and context >= 0, got rows={rows}, context={context}")
        c = self.cost
        if isinstance(c, TableCost):
            return c.prefill.at(rows, context)
        flops = (rows * (c.dense_flops_per_row + c.linear_flops_per_row)
                 + c.attention_flops_per_pair * rows * (context + rows / 2))
        nbytes = c.weight_bytes + (context + rows) * self._row_bytes + 2 * self._fixed_bytes
        return c.seconds(flops, nbytes) + c.chunk_overhead_s

    def decode_round_s(self, lanes: int, contexts: Sequence[int]) -> float:
        """Seconds for one decode step of `lanes` lanes; contexts[i]: rows lane i already holds.

        Analytic: max(F / (peak x eff), B / bw) + round_overhead_s with, over lanes,
          F = lanes x (dense + logits + linear flops per row) + pair flops x sum(context + 1),
          B = weight_bytes + sum(context + 1) x K/V row bytes + lanes x 2 x fixed state bytes.
        Table: the decode grid at (lanes, mean context). 0 lanes: 0.0.
        Raises ValueError: len(contexts) != lanes or a context < 0.
        """
        if lanes != len(contexts) or (lanes and min(contexts) < 0):
            raise ValueError(f"decode_round_s needs one context >= 0 per lane, got lanes={lanes}, "
                             f"contexts={list(contexts)[:8]}")
        return self.decode_round_total_s(lanes, sum(contexts))

    def decode_round_total_s(self, lanes: int, total_context: int) -> float:
        """`decode_round_s` given only the sum of the lanes' contexts (all it depends on).

        The simulator's fast-forward calls this once per round with the total grown by
        `lanes`, which gives the same bits as `decode_round_s` on the per-lane contexts.
        """
        if lanes == 0:
            return 0.0
        c = self.cost
        if isinstance(c, TableCost):
            return c.decode.at(lanes, total_context / lanes)
        keys = total_context + lanes
        per_lane = c.dense_flops_per_row + c.logits_flops_per_row + c.linear_flops_per_row
        flops = lanes * per_lane + c.attention_flops_per_pair * keys
        nbytes = c.weight_bytes + keys * self._row_bytes + lanes * 2 * self._fixed_bytes
        return c.seconds(flops, nbytes) + c.round_overhead_s

    def host_s(self, lanes: int, chunk: bool) -> float:
        """The serving loop's host seconds of one step (round) with `lanes` decode lanes and,
        when `chunk`, a prefill chunk: `HostCost.seconds` of a table profile that has host
        terms, else 0.0 (analytic profiles fold fixed costs into their overheads)."""
        c = self.cost
        if isinstance(c, TableCost) and c.host is not None:
            return c.host.seconds(lanes, chunk)
        return 0.0

    def decode_span(self, lanes: int, total_context: int, max_rounds: int, t0: float,
                    horizon: float | None) -> tuple[int, float]:
        """Run up to `max_rounds` decode rounds from time t0 (s); stop after the round that
        ends at or past `horizon`. Returns (rounds, end time).

        Each round adds `decode_round_total_s(lanes, total) + host_s(lanes, False)` to the
        clock, total growing by `lanes` per round, with the same floating-point operations in
        the same order as `sim.loop` costs one round, so the end time has the bits of
        committing the rounds one by one.
        """
        c = self.cost
        t, rounds, total = t0, 0, total_context
        host = self.host_s(lanes, False) if lanes else 0.0
        if isinstance(c, TableCost) or lanes == 0:
            while rounds < max_rounds:
                t += self.decode_round_total_s(lanes, total) + host
                rounds += 1
                if horizon is not None and t >= horizon:
                    break
                total += lanes
            return rounds, t
        per_lane = c.dense_flops_per_row + c.logits_flops_per_row + c.linear_flops_per_row
        lane_flops = lanes * per_lane
        pair, row_bytes, bw = c.attention_flops_per_pair, self._row_bytes, c.copy_bytes_per_s
        peak = c.matrix_flops_per_s * c.matrix_efficiency
        fixed = lanes * 2 * self._fixed_bytes
        weights, overhead = c.weight_bytes, c.round_overhead_s
        stop = math.inf if horizon is None else horizon
        while rounds < max_rounds:
            keys = total + lanes
            a = (lane_flops + pair * keys) / peak
            b = (weights + keys * row_bytes + fixed) / bw
            t += (max(b, a)) + overhead + host
            rounds += 1
            if t >= stop:
                break
            total += lanes
        return rounds, t

    def keep_s(self, nbytes: int) -> float:
        """Seconds to snapshot a kept state of `nbytes` bytes into the prompt cache.

        Analytic, or a table without a keep curve: bytes / copy_bytes_per_s. Table with a
        keep curve: the curve at nbytes (measured snapshots, fixed costs included).
        Raises ValueError: nbytes < 0.
        """
        if nbytes < 0:
            raise ValueError(f"keep_s needs nbytes >= 0, got {nbytes}")
        c = self.cost
        if isinstance(c, TableCost) and c.keep is not None:
            return c.keep.at(nbytes)
        return nbytes / c.copy_bytes_per_s

    def restore_s(self, nbytes: int) -> float:
        """Seconds to restore a kept state of `nbytes` bytes into a stream before it resumes.

        A table with a restore curve: the curve at nbytes; otherwise keep_s(nbytes).
        Raises ValueError: nbytes < 0.
        """
        if nbytes < 0:
            raise ValueError(f"restore_s needs nbytes >= 0, got {nbytes}")
        c = self.cost
        if isinstance(c, TableCost) and c.restore is not None:
            return c.restore.at(nbytes)
        return self.keep_s(nbytes)


def coverage_note(profile: Profile, chunk_rows: int, prompt_rows: int) -> str | None:
    """A line saying that a run goes past a table profile's measured points, or None.

    chunk_rows: the policy's longest prefill chunk; prompt_rows: the workload's longest
    prompt (rows). A table prices a chunk longer than its last row point, or after more
    context than its last context point, by extending its last segment (`Grid.at`), which
    is a guess past the measured range (a tiny CPU-measured profile gave TTFTs of minutes
    on a chat workload). Analytic profiles cover everything: None.
    """
    c = profile.cost
    if not isinstance(c, TableCost):
        return None
    rows, context = int(c.prefill.x[-1]), int(c.prefill.y[-1])
    past = []
    if chunk_rows > rows:
        past.append(f"chunks of up to {chunk_rows:,} rows (measured: {rows:,})")
    if prompt_rows > context + min(chunk_rows, rows):
        past.append(f"prompts of up to {prompt_rows:,} rows (measured: context {context:,} + a chunk)")
    if not past:
        return None
    return f"note: profile {profile.name}'s tables are extended past their points for " + " and ".join(past)


def _cost_from_dict(obj: Any) -> AnalyticCost | TableCost:
    where = "cost."
    form = obj.get("form") if isinstance(obj, dict) else None
    if form == "analytic":
        names = [a.name for a in attrs.fields(AnalyticCost)]
        _keys(obj, where, ["form", *names])
        values = {n: _number(obj, n, where, integer=n == "weight_bytes") for n in names}
        for n in ("matrix_flops_per_s", "copy_bytes_per_s"):
            _number(obj, n, where, open_lo=True)
        _number(obj, "matrix_efficiency", where, hi=1.0, open_lo=True)
        return AnalyticCost(**values)
    if form == "table":
        _keys(obj, where, ["form", "prefill", "decode", "copy_bytes_per_s"], ["keep", "restore", "host"])
        curves = {k: _curve(obj[k], f"cost.{k}.") for k in ("keep", "restore") if k in obj}
        host = _host(obj["host"], "cost.host.") if "host" in obj else None
        return TableCost(prefill=_grid(obj["prefill"], "cost.prefill.", "rows", "context"),
                         decode=_grid(obj["decode"], "cost.decode.", "lanes", "context"),
                         copy_bytes_per_s=_number(obj, "copy_bytes_per_s", where, open_lo=True), host=host, **curves)
    raise ValueError(f"cost.form: must be \"analytic\" or \"table\", got {form!r}")


def _axis(obj: dict[str, Any], where: str, name: str) -> tuple[float, ...]:
    axis = obj[name]
    ok = isinstance(axis, list) and axis and all(_is_number(v) and v >= 0 for v in axis)
    if not ok or any(a >= b for a, b in itertools.pairwise(axis)):
        raise ValueError(f"{where}{name}: must be a non-empty, strictly ascending list of numbers >= 0, "
                         f"got {axis!r}")
    return tuple(float(v) for v in axis)


HOST_MAX_S = 1.0
"""Largest host seconds per step, lane or chunk a profile may hold (a bigger one is a unit slip)."""


def _host(obj: Any, where: str) -> HostCost:
    names = [a.name for a in attrs.fields(HostCost)]
    _keys(obj, where, names)
    return HostCost(**{n: float(_number(obj, n, where, hi=HOST_MAX_S)) for n in names})


def _curve(obj: Any, where: str) -> Curve:
    _keys(obj, where, ["bytes", "seconds"])
    x = _axis(obj, where, "bytes")
    seconds = obj["seconds"]
    ok = isinstance(seconds, list) and len(seconds) == len(x) and all(_is_number(v) and v >= 0 for v in seconds)
    if not ok:
        raise ValueError(f"{where}seconds: must be {len(x)} numbers >= 0 (one per bytes point), got {seconds!r}")
    return Curve(x=x, seconds=tuple(float(v) for v in seconds))


def _grid(obj: Any, where: str, x_name: str, y_name: str) -> Grid:
    _keys(obj, where, [x_name, y_name, "seconds"])
    axes = [_axis(obj, where, x_name), _axis(obj, where, y_name)]
    table = obj["seconds"]
    if not isinstance(table, list) or len(table) != len(axes[0]):
        raise ValueError(f"{where}seconds: must be a list of {len(axes[0])} rows (one per {x_name} point)")
    for i, row in enumerate(table):
        ok = isinstance(row, list) and len(row) == len(axes[1])
        if not ok or not all(_is_number(v) and v >= 0 for v in row):
            raise ValueError(f"{where}seconds[{i}]: must be {len(axes[1])} numbers >= 0 (one per {y_name} point), "
                             f"got {row!r}")
    return Grid(x=axes[0], y=axes[1], seconds=tuple(tuple(float(v) for v in row) for row in table))


def profile_from_dict(obj: Any) -> Profile:
    """A Profile from its JSON object (sim/README.md). Raises ValueError naming the field."""
    _keys(obj, "", ["name", "source", "gpu", "model", "shape", "invariant_rows", "cost"], ["notes", "provenance"])
    for key in ("name", "gpu", "model", "notes"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f"{key}: must be a string, got {obj[key]!r}")
    prov = obj.get("provenance", {})
    if not isinstance(prov, dict) or not all(isinstance(v, str) for v in prov.values()):
        raise ValueError(f"provenance: must be a JSON object of strings, got {prov!r}")
    if obj["source"] not in SOURCES:
        raise ValueError(f"source: must be one of {SOURCES}, got {obj['source']!r}")
    g = obj["invariant_rows"]
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
        raise ValueError(f"invariant_rows: must be null or a positive integer, got {g!r}")
    names = [a.name for a in attrs.fields(ModelShape)]
    shape = _keys(obj["shape"], "shape.", names[:9], names[9:])
    for key, value in shape.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"shape.{key}: must be an integer, got {value!r}")
    try:
        model_shape = ModelShape(**shape)
    except (ValueError, TypeError) as e:
        raise ValueError(f"shape.{e}") from None
    return Profile(name=obj["name"], source=obj["source"], gpu=obj["gpu"], model=obj["model"], shape=model_shape,
                   invariant_rows=g, cost=_cost_from_dict(obj["cost"]), notes=obj.get("notes", ""),
                   provenance=tuple(prov.items()))


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON object of `profile`; profile_from_dict reads it back equal."""
    c = profile.cost
    if isinstance(c, AnalyticCost):
        cost: dict[str, Any] = {"form": "analytic", **attrs.asdict(c)}
    else:
        cost = {"form": "table", "copy_bytes_per_s": c.copy_bytes_per_s,
                "prefill": {"rows": list(c.prefill.x), "context": list(c.prefill.y),
                            "seconds": [list(r) for r in c.prefill.seconds]},
                "decode": {"lanes": list(c.decode.x), "context": list(c.decode.y),
                           "seconds": [list(r) for r in c.decode.seconds]}}
        for key, curve in (("keep", c.keep), ("restore", c.restore)):
            if curve is not None:
                cost[key] = {"bytes": list(curve.x), "seconds": list(curve.seconds)}
        if c.host is not None:
            cost["host"] = attrs.asdict(c.host)
    out = {"name": profile.name, "source": profile.source, "gpu": profile.gpu, "model": profile.model,
           "invariant_rows": profile.invariant_rows, "shape": attrs.asdict(profile.shape), "cost": cost,
           "notes": profile.notes}
    if profile.provenance:
        out["provenance"] = dict(profile.provenance)
    return out


def list_profiles() -> tuple[str, ...]:
    """Names of the shipped profiles (sim/profiles/*.json), sorted."""
    return tuple(sorted(p.stem for p in PROFILE_DIR.glob("*.json")))


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> Profile:
    """A shipped profile by name (see list_profiles; default qwen3.5-9b-h200) or a JSON file.

    Raises:
      ValueError: neither a shipped name nor a file, bad JSON, or a bad field (named, with the file).
    """
    text = str(name_or_path)
    path = PROFILE_DIR / f"{text}.json" if text in list_profiles() else Path(text)
    if not path.is_file():
        raise ValueError(f"profile {text!r}: not a shipped profile ({', '.join(list_profiles())}) nor a file")
    try:
        return profile_from_dict(json.loads(path.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e.msg} (line {e.lineno})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
