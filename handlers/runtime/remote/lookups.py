"""The sparse part of a dense host: a batch's ids sent to the embedding shards that own their
tables, one call per shard, all in flight at once; their pooled embeddings put back in model
feature order for the dense part.

    batch ids (JaggedIds, F features x N items)
        ├─ features of shard a ─> gRPC Predictions(model "criteo-a") ─> embeddings [N, W_a]
        └─ features of shard b ─> gRPC Predictions(model "criteo-b") ─> embeddings [N, W_b]
    -> [N, F, D] (or [N, sum of widths]) in the model's feature order

(W_s: the widths of the shard's features, summed; each item's pooled embeddings, feature after
feature.)

A call is a KServe v2 binary request (``sparse_features.lengths`` [F_s, N], ``.values``,
``.weights``) carried in TorchServe's gRPC ``PredictionsRequest``, answered with one FP32 tensor,
``embeddings``. ``ShardCaller`` makes the calls of one shard: a live replica first (round robin),
failing over to the next on any error but a refused request, within the shard's deadline
(``plan.Deadline``); when every replica fails, the request is answered 503 naming the shard.
"""

from __future__ import annotations

import collections
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
from handlers.runtime.wire.kserve_v2 import EMBEDDINGS, HEADER_LENGTH
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
        self.num_features = len(features)
        self.stacked = stacked
        position = {f: i for i, f in enumerate(features)}
        placed = [f for s in self.shards for f in s.route.features]
        if sorted(placed) != sorted(features):
            raise ValueError(f"shards: serve features {sorted(placed)}, the model has {sorted(features)}")
        self.feature_rows = [[position[f] for f in s.route.features] for s in self.shards]
        # The shards' answers side by side hold each feature's columns somewhere: gather them
        # back in model order.
        columns: dict[str, list[int]] = {}
        start = 0
        for shard in self.shards:
            for feature, width in zip(shard.route.features, shard.route.widths):
                columns[feature] = list(range(start, start + width))
                start += width
        self.columns = torch.tensor([c for f in features for c in columns[f]])
        self.widths = [sum(s.route.widths) for s in self.shards]

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
        num_items = ids.lengths.shape[1]
        totals = ids.lengths.sum(dim=1).tolist()  # ids per feature
        starts = [0, *itertools.accumulate(totals)]
        pending = [
            shard.call(*encode_request(self._inputs(ids, rows, starts), outputs=(EMBEDDINGS,)))
            for shard, rows in zip(self.shards, self.feature_rows)
        ]
        parts = [call.result().reshape(num_items, width) for call, width in zip(pending, self.widths)]
        embeddings = torch.cat(parts, dim=1).index_select(1, self.columns)
        return embeddings.reshape(num_items, self.num_features, -1) if self.stacked else embeddings

    def _inputs(self, ids: JaggedIds, rows: list[int], starts: list[int]) -> dict[str, np.ndarray]:
        """One shard's share of the batch's ids: its features' bags, in its order; ``starts``:
        where each feature's ids begin in ``ids.values`` (and, last, their total)."""
        pieces = [slice(starts[f], starts[f + 1]) for f in rows]
        inputs = {
            f"{self.jagged}.lengths": ids.lengths[rows].numpy(),
            f"{self.jagged}.values": torch.cat([ids.values[p] for p in pieces]).numpy(),
        }
        if self.weighted:
            assert ids.weights is not None
            inputs[f"{self.jagged}.weights"] = torch.cat([ids.weights[p] for p in pieces]).numpy()
        return inputs


class ShardCaller:
    """The gRPC calls of one shard, over its replicas (``route.replicas``), with fail-over within
    its deadline. ``counts`` sums what it did, for the handler's metrics: calls by outcome
    (``ok`` or the gRPC status of a failed attempt) and call milliseconds, keyed as
    ``(metric, labels)``."""

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
        self.future = self.caller._stubs[replica].Predictions.future(self.request, timeout=timeout)

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
