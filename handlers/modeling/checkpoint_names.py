"""Why a checkpoint's names do not match the model's, in one short line: a few names of each kind
with their counts, the MCH eviction policy a table's extra state belongs to, and the
``checkpoint_mapping`` that makes the names match where a few prefix rules do.

    mismatch(names_under, mapping, expected, misshaped)
    # 'checkpoint does not match the spec (after checkpoint_mapping): 182 missing: a, b, c and
    #  179 more; 182 unexpected: ...; put checkpoint_mapping: {prefixes: {"": "din."}} in the
    #  spec: then every name matches'

A suggested rule rewrites a prefix: added (``{"model.": ""}``), removed (``{"": "din."}``), renamed
or with a segment inserted (``{"sparse.ebc.": "sparse.ebc.mc."}``). Each is read off a pair of
names that end alike (an unexpected one, a missing one) and kept if, applied after the spec's own
rules to every checkpoint name, it leaves fewer names unmatched.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Callable, Iterable

from handlers.modeling.raw_ids import mch_eviction_state
from handlers.modeling.remap_spec import MchEviction
from handlers.modeling.spec import CheckpointMapping

SHOWN = 3  # names shown of each kind
RULES = 3  # prefix rules a suggestion adds, at most
TRIED = 5  # the rules most pairs of names agree on, tried at each step

NamesUnder = Callable[[CheckpointMapping], set[str]]  # a mapping -> the checkpoint's names, mapped


def mismatch(names_under: NamesUnder, mapping: CheckpointMapping, expected: set[str], misshaped: list[str]) -> str:
    """The error of a checkpoint whose names (under the spec's ``mapping``) are not ``expected``,
    or whose tensors are ``misshaped`` ("name: checkpoint (r, d) vs model (r, d)")."""
    names = names_under(mapping)
    missing, unexpected = expected - names, names - expected
    hints, explained = _eviction_hints(names, expected, missing | unexpected)
    missing, unexpected = missing - explained, unexpected - explained
    parts = hints + [
        _listed(label, keys)
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
        if keys
    ]
    suggested = _suggested(names_under, mapping, expected, missing, unexpected, explained)
    if suggested is not None:
        parts.append(suggested)
    elif missing or unexpected:
        parts.append("map other names with checkpoint_mapping.prefixes in the spec")
    if misshaped:
        parts.append("shapes come from its tables (rows, dim) and MLP sizes")
    return "checkpoint does not match the spec (after checkpoint_mapping): " + "; ".join(parts)


def _listed(label: str, names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} {label}: {', '.join(names[:SHOWN])}{more}"


def _eviction_hints(names: set[str], expected: set[str], unmatched: set[str]) -> tuple[list[str], set[str]]:
    """Where an MCH table's unmatched state is another eviction policy's: a line per (spec's,
    trained) policy naming the setting, and the names it explains."""
    state = mch_eviction_state()
    eviction_names = frozenset().union(*state.values())

    def policy(table: str, among: set[str]) -> MchEviction | None:
        held = {n[len(table) + 1 :] for n in among if n.rsplit(".", 1)[0] == table} & eviction_names
        return next((e for e, s in state.items() if s == held), None)

    tables = {n.rsplit(".", 1)[0] for n in unmatched if n.rsplit(".", 1)[-1] in eviction_names}
    groups: dict[tuple[MchEviction, MchEviction], list[str]] = defaultdict(list)
    for table in sorted(tables):
        spec, trained = policy(table, expected), policy(table, names)
        if spec is not None and trained is not None and spec != trained:
            groups[spec, trained].append(table)
    hints, explained = [], set()
    for (spec, trained), group in groups.items():
        short = sorted(t.rsplit(".", 1)[-1] for t in group)
        more = f" and {len(short) - SHOWN} more" if len(short) > SHOWN else ""
        hints.append(
            f"{len(short)} MCH tables ({', '.join(short[:SHOWN])}{more}) hold the state of eviction "
            f"{trained.value} ({', '.join(sorted(state[trained]))}), the spec's remap.eviction is {spec.value}: set "
            f"remap.eviction: {trained.value} on them, as trained"
        )
        explained |= {n for n in unmatched if n.rsplit(".", 1)[0] in group}
    return hints, explained


def _suggested(
    names_under: NamesUnder, mapping: CheckpointMapping, expected: set[str],
    missing: set[str], unexpected: set[str], explained: set[str],
) -> str | None:
    """The spec text of a mapping that leaves fewer names unmatched, with what it leaves; None if
    no prefix rule helps."""

    def unmatched(trial: CheckpointMapping) -> tuple[set[str], set[str]]:
        names = names_under(trial)
        return expected - names - explained, names - expected - explained

    best, left = mapping, (missing, unexpected)
    for _ in range(RULES):
        trials = [
            CheckpointMapping(prefixes={**best.prefixes, old: new})
            for (old, new), _ in _rules(*left).most_common(TRIED)
            if old not in best.prefixes
        ]
        scored = [(sum(map(len, unmatched(t))), i) for i, t in enumerate(trials)]
        if not scored or min(scored)[0] >= sum(map(len, left)):
            break
        best = trials[min(scored)[1]]
        left = unmatched(best)
    if best is mapping:
        return None
    rules = ", ".join(f"{json.dumps(old)}: {json.dumps(new)}" for old, new in best.prefixes.items())
    missing, unexpected = map(len, left)
    then = f"{missing} missing and {unexpected} unexpected remain" if missing or unexpected else "every name matches"
    return f"put checkpoint_mapping: {{prefixes: {{{rules}}}}} in the spec: then {then}"


def _rules(missing: set[str], unexpected: set[str]) -> Counter[tuple[str, str]]:
    """Prefix rules (old, new), each counted once per unexpected name it maps onto a missing one
    that ends alike (their longest common ending, in whole segments)."""
    endings: dict[str, list[str]] = defaultdict(list)  # an ending of missing names -> what comes before
    for name in missing:
        parts = name.split(".")
        for i in range(len(parts)):
            endings[".".join(parts[i:])].append(_prefix(parts[:i]))
    rules: Counter[tuple[str, str]] = Counter()
    for name in unexpected:
        parts = name.split(".")
        found = next((i for i in range(len(parts)) if ".".join(parts[i:]) in endings), None)
        news = [] if found is None else endings[".".join(parts[found:])]
        if len(news) <= TRIED:  # an ending many names share (``weight``) says nothing
            rules.update((_prefix(parts[:found]), new) for new in news)
    return rules


def _prefix(parts: list[str]) -> str:
    return "".join(f"{p}." for p in parts)
