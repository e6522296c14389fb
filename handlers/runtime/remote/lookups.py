"""The sparse part of a dense host: a batch's ids sent to the embedding shards that own their
tables, one call per shard, all in flight at once; their pooled embeddings put back in model
feature order for the dense part.

    batch ids (JaggedIds, F features x N items)
        ├─ features of shard a, distinct bags ─> gRPC Predictions(model "criteo-a") ─> embeddings
        └─ features of shard b, distinct bags ─> gRPC Predictions(model "criteo-b") ─> embeddings
    -> [N, F, D] (or [N, sum of widths]) in the model's feature order

Each distinct bag is sent once: a bag equal to the one before it in its feature (the item before
it) is left out and answered with that one's embedding. Ranking requests repeat the user's
features in each of their candidates, so most of a request's bags go once instead of once per
candidate (``distinct_ids``).

A call is a KServe v2 binary request (``sparse_features.lengths`` [F_s, n], ``.values``,
``.weights``, and ``.bags`` [F_s]: feature f's bags are its first bags_f items) carried in
TorchServe's gRPC ``PredictionsRequest``, answered with one FP32 tensor, ``embeddings``: each
feature's [bags_f, D_f] block, feature after feature, flat. ``ShardCaller`` makes the calls of
one shard: a live replica first (round robin), failing over to the next on any error but a
refused request, within the shard's deadline (``plan.Deadline``); when every replica fails, the
request is answered 503 naming the shard.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import time
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from handlers.runtime.batching import Batch
from handlers.runtime.errors import InternalError, ShardUnavailable
from handlers.runtime.inputs import JaggedIds
from handlers.runtime.remote.plan import Deadline, ShardRoute
from handlers.runtime.service import ScoringService
from handlers.runtime.wire.messages import BinaryBody
from handlers.runtime.wire.v2_answers import EMBEDDINGS
from handlers.runtime.wire.v2_headers import HEADER_LENGTH
from handlers.runtime.wire.v2_tensors import V2Error, decode_response, encode_request

# gRPC settings of every shard channel: reconnect soon after a replica comes back (gRPC's default
# backoff grows to 2 minutes), and room for a large batch's ids and embeddings.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
)
MEASURED_CALLS = 200  # the recent calls whose p99 sets a shard's attempt timeout


class PendingCall(Protocol):
    def result(self) -> torch.Tensor:
        """The shard's embeddings [N, F_s * D]; raises ``ShardUnavailable`` or ``InternalError``."""


class Shard(Protocol):
    route: ShardRoute

    def call(self, body: bytes, json_length: int) -> PendingCall:
        """Sends one v2 request; the answer is waited for by ``result()``."""


class ShardedLookups:
    """Runs a batch's lookups on the shards, like the sparse part of a split model:
    ``__call__(batch) -> [N, F, D]`` when ``stacked``, else [N, sum of widths]. ``features``: the
    model's, in order; ``jagged``: the name of its ids input."""

    def __init__(
        self, shards: Sequence[Shard], features: Sequence[str], jagged: str, weighted: bool, stacked: bool
    ) -> None:
        self.shards = list(shards)
        self.jagged = jagged
        self.weighted = weighted
        self.stacked = stacked
        position = {f: i for i, f in enumerate(features)}
        placed = [f for s in self.shards for f in s.route.features]
        if sorted(placed) != sorted(features):
            raise ValueError(f"shards: serve features {sorted(placed)}, the model has {sorted(features)}")
        self.feature_rows = [[position[f] for f in s.route.features] for s in self.shards]

    def take_counts(self) -> collections.Counter:
        """What the shard calls did since the last take (``ShardCaller.counts``), for metrics."""
        total: collections.Counter = collections.Counter()
        for shard in self.shards:
            counts = getattr(shard, "counts", None)
            if counts:
                total.update(counts)
                counts.clear()
        return total

    def __call__(self, batch: Batch) -> torch.Tensor:
        ids = batch[self.jagged]
        assert isinstance(ids, JaggedIds)
        sent = distinct_ids(ids)
        bags = sent.bags.tolist()
        starts = [0, *itertools.accumulate(sent.ids.lengths.sum(dim=1).tolist())]  # each feature's ids
        pending = [
            shard.call(*encode_request(self._inputs(sent.ids, rows, starts, bags), outputs=(EMBEDDINGS,)))
            for shard, rows in zip(self.shards, self.feature_rows)
        ]
        columns: dict[int, torch.Tensor] = {}  # model feature -> [N, D_f]
        for shard, call, rows in zip(self.shards, pending, self.feature_rows):
            widths = shard.route.widths
            sizes = [bags[f] * width for f, width in zip(rows, widths)]
            answer = call.result().reshape(-1)
            if answer.numel() != sum(sizes):
                raise InternalError(
                    f"shard {shard.route.name} answered {answer.numel()} values for {sum(sizes)} "
                    "(its features' bags x widths)"
                )
            for f, width, block in zip(rows, widths, answer.split(sizes)):
                columns[f] = block.view(bags[f], width).index_select(0, sent.row[f])  # [N, D_f]
        embeddings = torch.cat([columns[f] for f in range(len(bags))], dim=1)
        return embeddings.reshape(embeddings.shape[0], len(bags), -1) if self.stacked else embeddings

    def _inputs(self, ids: JaggedIds, rows: list[int], starts: list[int], bags: list[int]) -> dict[str, np.ndarray]:
        """One shard's share of the distinct bags: its features', in its order; ``starts``: where
        each feature's ids begin in ``ids.values`` (and, last, their total)."""
        pieces = [slice(starts[f], starts[f + 1]) for f in rows]
        shard_bags = [bags[f] for f in rows]
        inputs = {
            f"{self.jagged}.lengths": ids.lengths[rows, : max(shard_bags)].numpy(),
            f"{self.jagged}.values": torch.cat([ids.values[p] for p in pieces]).numpy(),
            f"{self.jagged}.bags": np.array(shard_bags, dtype=np.int64),
        }
        if self.weighted:
            assert ids.weights is not None
            inputs[f"{self.jagged}.weights"] = torch.cat([ids.weights[p] for p in pieces]).numpy()
        return inputs


@dataclasses.dataclass(frozen=True)
class DistinctIds:
    """A batch's distinct bags (``distinct_ids``): ``ids`` holds each feature's distinct bags
    first, in order, then empty bags (lengths [F, N]); ``bags`` [F]: how many each feature has;
    ``row`` [F, N]: which of its feature's distinct bags each item's bag is."""

    ids: JaggedIds
    bags: torch.Tensor
    row: torch.Tensor


def distinct_ids(ids: JaggedIds) -> DistinctIds:
    """Each bag that equals the one before it in its feature (same ids, same weights) is left
    out and mapped to it. Only neighbours are compared (one pass over the ids): the items of a
    request that repeat the user's features are neighbours."""
    num_features, num_items = ids.lengths.shape
    lengths = ids.lengths.reshape(-1)  # bag b: feature b // N, item b % N
    bag_of_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=len(ids.values))
    # The id at the same place in the bag before; meaningful where the two bags are equally long.
    before = (torch.arange(len(ids.values)) - lengths[bag_of_id]).clamp(min=0)
    differs = ids.values != ids.values[before]
    if ids.weights is not None:
        differs |= ids.weights != ids.weights[before]
    mismatched = torch.zeros(len(lengths), dtype=torch.int64).index_add_(0, bag_of_id, differs.to(torch.int64))
    repeats = torch.zeros(len(lengths), dtype=torch.bool)
    repeats[1:] = (lengths[1:] == lengths[:-1]) & (mismatched[1:] == 0)
    repeats = repeats.reshape(num_features, num_items)
    repeats[:, 0] = False  # a feature's first item: the bag before it is another feature's
    kept = ~repeats
    row = kept.cumsum(dim=1) - 1
    bags = row[:, -1] + 1
    features, items = kept.nonzero(as_tuple=True)
    distinct_lengths = torch.zeros_like(ids.lengths)
    distinct_lengths[features, row[features, items]] = ids.lengths[features, items]
    kept_ids = torch.repeat_interleave(kept.reshape(-1), lengths, output_size=len(ids.values))
    distinct = JaggedIds(
        lengths=distinct_lengths,
        values=ids.values[kept_ids],
        weights=None if ids.weights is None else ids.weights[kept_ids],
    )
    return DistinctIds(distinct, bags, row)


class ShardCaller:
    """The gRPC calls of one shard, over its replicas (``route.replicas``), with fail-over within
    its deadline. ``counts`` sums what it did, for the handler's metrics: calls by outcome
    (``ok`` or the gRPC status of a failed attempt) and call milliseconds, keyed as
    ``(metric, labels)``.

    Each attempt is a blocking gRPC call on the shard's own thread: gRPC's ``future()`` would start
    a thread to poll the channel whenever none of its calls is in flight, which at one forward at a
    time is once per call (measured: 0.5-1.4 ms more for a batch's calls to two shards). A worker
    runs one forward at a time, so one thread per shard is enough."""

    def __init__(self, route: ShardRoute, deadline: Deadline) -> None:
        import grpc  # only dense hosts talk gRPC

        from handlers.runtime.remote.grpc_stubs import inference_stub, messages

        if not route.replicas:
            raise ValueError(f"shard {route.name}: no replica address")
        self.route = route
        self.deadline = deadline
        self._grpc = grpc
        self._messages = messages()
        self._channels = [grpc.insecure_channel(r, options=CHANNEL_OPTIONS) for r in route.replicas]
        self._stubs = [inference_stub(c) for c in self._channels]
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"shard-{route.name}")
        self._down_until = [0.0] * len(route.replicas)
        self._turn = itertools.count()
        self._recent: collections.deque[float] = collections.deque(maxlen=MEASURED_CALLS)
        self.counts: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = collections.Counter()

    def connect(self, timeout_s: float) -> list[str]:
        """Connects to every replica, waiting up to ``timeout_s`` in all (a first connection to
        TorchServe's gRPC server takes a few hundred ms: not a first request's); returns the
        replicas not connected yet (they are tried last until they answer)."""
        futures = [self._grpc.channel_ready_future(c) for c in self._channels]
        give_up_at = time.monotonic() + timeout_s
        missing = []
        for replica, future in enumerate(futures):
            try:
                future.result(timeout=max(give_up_at - time.monotonic(), 0.0))
            except self._grpc.FutureTimeoutError:
                future.cancel()
                self._down_until[replica] = time.monotonic() + self.deadline.retry_after_s
                missing.append(self.route.replicas[replica])
        return missing

    def attempt_timeout_s(self) -> float:
        """``multiple`` x the recent p99 call time, within the deadline's bounds."""
        d = self.deadline
        if len(self._recent) < 20:
            return d.max_ms / 1000
        recent = sorted(self._recent)  # 200 floats, once a call
        p99 = recent[int(0.99 * (len(recent) - 1))]
        return min(max(d.multiple * p99, d.floor_ms / 1000), d.max_ms / 1000)

    def is_down(self, replica: int, now: float) -> bool:
        """Whether ``replica`` failed within the last ``retry_after_s``."""
        return self._down_until[replica] > now

    def replica_order(self, now: float) -> list[int]:
        """Live replicas in turn, then those that failed lately (tried last, so they recover)."""
        n = len(self._stubs)
        first = next(self._turn) % n
        turn = [(first + k) % n for k in range(n)]
        return [r for r in turn if not self.is_down(r, now)] + [r for r in turn if self.is_down(r, now)]

    def call(self, body: bytes, json_length: int) -> "_Call":
        request = self._messages.PredictionsRequest(
            model_name=self.route.model, input={"body": body, HEADER_LENGTH: str(json_length).encode()}
        )
        return _Call(self, request)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels:
            channel.close()

    # -- what a call reports -------------------------------------------------------------------

    def _succeeded(self, replica: int, seconds: float) -> None:
        self._down_until[replica] = 0.0
        self._recent.append(seconds)
        self._count("ok", seconds)

    def _failed(self, replica: int, code: str, seconds: float) -> None:
        self._down_until[replica] = time.monotonic() + self.deadline.retry_after_s
        self._count(code, seconds)

    def _count(self, outcome: str, seconds: float) -> None:
        labels = (("Shard", self.route.name),)
        self.counts[("ShardCalls", labels + (("Outcome", outcome),))] += 1
        self.counts[("ShardCallMilliseconds", labels)] += seconds * 1000


class _Call:
    """One shard call in flight: started at once on the first replica in order; ``result()``
    waits, and tries the next replica while the deadline allows."""

    def __init__(self, caller: ShardCaller, request: Any) -> None:
        self.caller = caller
        self.request = request
        self.started = time.monotonic()
        self.timeout_s = caller.attempt_timeout_s()
        budget_s = max(caller.deadline.max_ms / 1000, self.timeout_s * len(caller._stubs))
        self.give_up_at = self.started + budget_s
        self.order = caller.replica_order(self.started)
        self.errors: list[str] = []
        self._attempt(self.order.pop(0))

    def _attempt(self, replica: int) -> None:
        """An attempt gets the attempt timeout while a live replica is left to try after it, and
        the rest of the deadline when it is the last hope (its replica then carries the load of
        those that failed, and answers slower than the p99 measured before)."""
        self.replica = replica
        now = self.attempt_started = time.monotonic()
        remaining = max(self.give_up_at - now, 0.001)
        live_after = any(not self.caller.is_down(r, now) for r in self.order)
        timeout = min(self.timeout_s, remaining) if live_after else remaining
        self.future = self.caller._thread.submit(self.caller._stubs[replica].Predictions, self.request, timeout=timeout)

    def result(self) -> torch.Tensor:
        caller, grpc = self.caller, self.caller._grpc
        while True:
            try:
                answer = self.future.result()
            except grpc.RpcError as error:
                code = error.code()
                seconds = time.monotonic() - self.attempt_started
                caller._failed(self.replica, code.name, seconds)
                address = caller.route.replicas[self.replica]
                self.errors.append(f"{address}: {code.name} after {seconds * 1000:.0f} ms ({error.details()})")
                if code == grpc.StatusCode.INVALID_ARGUMENT:  # the shard refused what this host sent
                    raise InternalError(f"shard {caller.route.name} refused the lookups: {error.details()}")
                if self.order and time.monotonic() < self.give_up_at:
                    self._attempt(self.order.pop(0))
                    continue
                waited = (time.monotonic() - self.started) * 1000
                raise ShardUnavailable(caller.route.name, waited, self.errors) from None
            caller._succeeded(self.replica, time.monotonic() - self.attempt_started)
            try:
                embeddings = decode_response(answer.prediction)[EMBEDDINGS]
            except (V2Error, ValueError, KeyError) as e:
                raise InternalError(f"shard {caller.route.name} answered what is not embeddings: {e!r}") from None
            return torch.from_numpy(np.array(embeddings, dtype=np.float32))


@dataclasses.dataclass
class Answered:
    """A call answered at once (an in-process shard): ``result()`` gives ``embeddings``."""

    embeddings: torch.Tensor

    def result(self) -> torch.Tensor:
        return self.embeddings


class InProcessShard:
    """A shard served in this process by its own scoring service, through the same v2 bytes a
    remote one gets: how the archive tool verifies a distributed build before any host runs it."""

    def __init__(self, route: ShardRoute, service: ScoringService) -> None:
        self.route = route
        self.service = service

    def call(self, body: bytes, json_length: int) -> Answered:
        (response,) = self.service.handle([BinaryBody(body, json_length)]).responses
        length = response.headers.get(HEADER_LENGTH)
        if response.status != 200:
            raise InternalError(f"shard {self.route.name} answered {response.status}: {response.body!r}")
        outputs = decode_response(response.body, int(length) if length is not None else None)
        return Answered(torch.from_numpy(np.array(outputs[EMBEDDINGS], dtype=np.float32)))
