"""The own-model example served from a spec that lets two candidate ids through (the poisoned
requests' model, ``benchmarks.poisoned``). Its build still captures and verifies the model on
requests of one candidate id an item: it overrides ``synthetic_request``, as the architecture
contract allows. Imported by the build alone, with ``examples/own_model`` on ``PYTHONPATH``."""

from __future__ import annotations

from handlers.modeling.spec import IdsPerItem

from seq_ranker import SeqRankerArchitecture  # isort: skip


class LenientSeqRanker(SeqRankerArchitecture):
    def synthetic_request(self, spec, num_items, seed, max_bag=3, return_logits=False, owned_ids=None):
        item, *others = spec.tables
        strict = spec.replace(tables=[item.model_copy(update={"ids_per_item": IdsPerItem(min=1, max=1)}), *others])
        return super().synthetic_request(strict, num_items, seed, max_bag, return_logits, owned_ids)
