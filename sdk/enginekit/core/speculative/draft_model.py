"""The draft-model proposer: a smaller model with the target's vocabulary, run greedily for k tokens a step.

The draft runs beside the target, on rank 0, unsharded: its own weights (loaded as the target's are, a GGUF file's
kept as stored where the loader does so), its own ``ModelRunner`` and its own KV cache, whose blocks come from its
own ``BlockPool`` (no prefix caching: a draft's blocks are never shared). Each request keeps a ``DraftSequence``:
its blocks, how many of the request's tokens the draft's cache holds (``verified``), and the proposals the draft
fed itself after them (``fed``). A ``propose`` call then

1. brings each request's cache up to date: the fed proposals the target kept stay, the rest (and every token the
   request gained since) is computed again, in chunks under ``max_num_batched_tokens`` a forward pass; the pass
   that computes a request's last token samples its first proposal;
2. runs k - 1 decode passes over every request still proposing, each feeding the token the pass before sampled
   (``SequenceChunk.sampled_row``: the ids never leave the device between passes);
3. copies every proposal to the host at once.

So a step costs k forward passes of the draft (k + 1 when a request's last accepted token and the target's bonus
token must both be computed: they share the first pass), batched over the requests. Greedy means argmax over
the logits of the tokens both models have. A request that does not fit the draft's cache, or whose proposals
would pass the draft's positions, gets fewer proposals or none: the engine never fails for the draft's sake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from enginekit.config import EngineConfig
from enginekit.core.kv_cache import Block, BlockPool
from enginekit.core.resources import (
    kv_cache_budget,
    release_device_memory,
    size_kv_cache,
    useful_kv_cache_bytes,
)
from enginekit.core.speculative.proposer import ProposalRequest
from enginekit.errors import EngineStartupError
from enginekit.model.batch import ScheduledBatch, SequenceChunk
from enginekit.model.config import ModelConfig
from enginekit.model.formats.source import DEFAULT_MODEL
from enginekit.model.loader import load_model, load_model_spec
from enginekit.model.runner import ModelRunner
from enginekit.model.text.tokenizer import Tokenizer
from enginekit.sampling_params import SamplingParams

logger = logging.getLogger("enginekit.core")

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
# The text whose encodings the two tokenizers must agree on (besides every token's string).
PROBE_TEXT = 'The quick brown fox, 42 times: {"key": [1, 2.5]}\n\tdef f(x):\n    return x  # ok? Ça va!'


@dataclass
class DraftSequence:
    """What the draft's cache holds of one request: ``verified`` of its tokens, then the proposals in ``fed``."""

    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(
        default_factory=list
    )  # the same list from step to step (the runner keeps it)
    verified: int = 0
    fed: list[int] = field(default_factory=list)
    rope_long: bool = False


@dataclass
class _Plan:
    """One request's work in a ``propose`` call: compute ``tokens[start:]``, then propose ``count`` tokens."""

    index: int
    request_id: str
    sequence: DraftSequence
    tokens: list[int]  # the tokens to compute, from position ``start``
    start: int
    count: int
    done: int = 0  # of ``tokens``, computed so far in this call
    row: int = 0  # its row of the latest pass's sampled ids


class DraftModelProposer:
    """Proposes up to k tokens per request from a draft model run greedily (``{"method": "draft_model"}``).

    Build it with ``create``; the engine core calls ``propose`` once a step, ``forget`` when requests end or are
    preempted, and ``shutdown`` when it stops.
    """

    def __init__(
        self,
        runner: ModelRunner,
        draft: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        vocab_limit: int,
    ) -> None:
        self.runner = runner
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.token_budget = max_num_batched_tokens
        self.max_positions = draft.max_position_embeddings
        self.long_rope_from = draft.long_rope_from
        self.vocab_limit = vocab_limit  # proposals are argmax over the ids both models have
        self.sequences: dict[str, DraftSequence] = {}
        self._freed: list[str] = []
        self._warned_full = False

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        target: ModelConfig,
        tokenizer: Tokenizer,
        device: torch.device,
        dtype: torch.dtype,
        *,
        num_blocks: int | None = None,
    ) -> DraftModelProposer:
        """Load ``config.speculative.model`` on ``device`` in ``dtype``, check its vocabulary is the target's
        (``EngineStartupError`` naming both models and what differs) and give it a KV cache.

        ``num_blocks``: the target's KV block count; the draft's cache then holds as many tokens (its blocks are
        smaller when the draft is), plus each running request's k lookahead tokens. ``None``: the count the
        target gets from the config before any profiling (``num_kv_blocks``, ``kv_cache_memory_bytes`` or the CPU
        default); where the target's cache is sized by profiling CUDA, ``max_num_seqs`` requests of the longest
        length.
        """
        speculative = config.speculative
        assert speculative is not None and speculative.model is not None  # the config checked the method
        spec = load_model_spec(speculative.model)
        check_same_vocabulary(
            (config.model or DEFAULT_MODEL, target, tokenizer),
            (speculative.model, spec.config, spec.tokenizer),
        )
        model = load_model(
            spec, device=device, dtype=dtype, seed=config.seed, quantization=config.quantization
        )
        if num_blocks is None:
            budget = kv_cache_budget(config, target, device, dtype)
            if budget is None and config.num_kv_blocks is None:  # a CUDA cache sized by profiling
                budget = useful_kv_cache_bytes(config, target, dtype)
            num_blocks = size_kv_cache(config, target, dtype, budget).num_blocks
        k = speculative.num_speculative_tokens
        num_blocks += config.max_num_seqs * -(-k // config.block_size)
        longest = min(
            config.max_model_len or target.max_position_embeddings, spec.config.max_position_embeddings
        )
        runner = ModelRunner(
            model,
            spec.config,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=device,
            dtype=dtype,
            seed=config.seed,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=-(-(longest + k) // config.block_size),
        )
        logger.info(
            "draft model %s loaded for speculative decoding: %d tokens a step, a KV cache of %d blocks",
            speculative.model,
            k,
            num_blocks,
        )
        return cls(
            runner,
            spec.config,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            vocab_limit=min(target.vocab_size, spec.config.vocab_size),
        )

    # ---- the proposer interface ---------------------------------------------------------------------------
    def propose(self, requests: Sequence[ProposalRequest], limits: Sequence[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        plans = [
            plan
            for index, (request, limit) in enumerate(zip(requests, limits))
            if (plan := self._plan(index, request, limit)) is not None
        ]
        if not plans:
            return proposals
        with torch.inference_mode():
            passes = self._run(plans)
            flat = torch.cat([sampled for sampled, _ in passes]).tolist()  # the one copy back
        at = 0
        for _, rows in passes:
            for plan in rows:
                proposals[plan.index].append(flat[at])
                at += 1
        for plan in plans:
            sequence = plan.sequence
            sequence.verified = plan.start + len(plan.tokens)
            sequence.fed = proposals[plan.index][:-1]
        return proposals

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            sequence = self.sequences.pop(request_id, None)
            if sequence is not None:
                self.pool.release(sequence.blocks)
                self._freed.append(request_id)

    def shutdown(self) -> None:
        device = self.runner.device
        self.sequences.clear()
        self.runner.release()
        release_device_memory(device)

    # ---- one call's work ----------------------------------------------------------------------------------
    def _plan(self, index: int, request: ProposalRequest, limit: int) -> _Plan | None:
        """What to compute for ``request`` and how many tokens to propose; ``None``: none (no room)."""
        tokens = request.all_token_ids
        length = len(tokens)
        count = min(limit, self.max_positions - length + 1)  # the last proposal is never fed
        if count <= 0:
            return None
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            sequence = self.sequences[request.request_id] = DraftSequence()
        start = sequence.verified  # the request's tokens only grow: its first ``verified`` are still held
        for token in sequence.fed:  # then the proposals the target kept
            if start >= length or tokens[start] != token:
                break
            start += 1
        if (
            self.long_rope_from is not None
            and not sequence.rope_long
            and length + count - 1 > self.long_rope_from
        ):
            sequence.rope_long, start = True, 0  # every token rotated again with the long factors
        start = min(
            start, length - 1
        )  # the last token is always computed: its logits give the first proposal
        sequence.verified, sequence.fed = start, []  # what the cache holds, until this call completes
        needed = -(-(length + count - 1) // self.block_size) - len(sequence.blocks)
        if needed > 0:
            if needed > self.pool.num_free_blocks:
                self._warn_full()
                return None
            blocks = self.pool.allocate(needed)
            sequence.blocks += blocks
            sequence.block_ids.extend(block.block_id for block in blocks)
        return _Plan(index, request.request_id, sequence, tokens[start:], start, count)

    def _run(self, plans: list[_Plan]) -> list[tuple[torch.Tensor, list[_Plan]]]:
        """Every forward pass of the call; per pass, its sampled ids (on the device) and whose they are."""
        passes: list[tuple[torch.Tensor, list[_Plan]]] = []
        while True:  # catching up: the new tokens, under the token budget a pass
            waiting = [plan for plan in plans if plan.done < len(plan.tokens)]
            if not waiting:
                break
            chunks, sampling = self._catch_up_chunks(waiting)
            batch = ScheduledBatch(chunks, self.pool.num_used_blocks, freed_seq_ids=self._take_freed())
            passes.append((self._forward(batch), sampling))
        # the rows of the first proposals, in the order ``passes`` lists them
        previous = torch.cat([sampled for sampled, _ in passes]) if len(passes) > 1 else passes[0][0]
        row = 0
        for _, rows in passes:
            for plan in rows:
                plan.row, row = row, row + 1
        for step in range(1, max(plan.count for plan in plans)):
            active = [plan for plan in plans if plan.count > step]
            chunks = [
                SequenceChunk(
                    [0],  # a placeholder: the token is the pass before's sample, on the device
                    plan.start + len(plan.tokens) + step - 1,
                    plan.sequence.block_ids,
                    sampling_params=GREEDY,
                    rope_long=plan.sequence.rope_long,
                    sampled_row=plan.row,
                    seq_id=plan.request_id,
                )
                for plan in active
            ]
            batch = ScheduledBatch(chunks, self.pool.num_used_blocks, previous_token_ids=previous)
            previous = self._forward(batch)
            for row, plan in enumerate(active):
                plan.row = row
            passes.append((previous, active))
        return passes

    def _catch_up_chunks(self, waiting: list[_Plan]) -> tuple[list[SequenceChunk], list[_Plan]]:
        """One pass's chunks of the tokens still to compute (single tokens first, as the runner wants them), and
        the plans whose chunk ends their tokens (they sample), in the order their rows come out."""
        budget = self.token_budget
        singles: list[tuple[SequenceChunk, _Plan]] = []
        longer: list[tuple[SequenceChunk, _Plan]] = []
        for plan in waiting:
            if budget <= 0:
                break
            count = min(len(plan.tokens) - plan.done, budget)
            end = plan.done + count
            last = end == len(plan.tokens)
            chunk = SequenceChunk(
                plan.tokens[plan.done : end],
                plan.start + plan.done,
                plan.sequence.block_ids,
                sampling_params=GREEDY if last else None,
                rope_long=plan.sequence.rope_long,
                seq_id=plan.request_id,
            )
            (singles if count == 1 else longer).append((chunk, plan))
            plan.done, budget = end, budget - count
        ordered = singles + longer
        return [chunk for chunk, _ in ordered], [plan for chunk, plan in ordered if chunk.samples]

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The greedy ids of the batch's sampling chunks, on the device (argmax over the shared ids)."""
        logits = self.runner.forward_step(batch).logits
        if logits.shape[-1] > self.vocab_limit:
            logits = logits[:, : self.vocab_limit]
        return logits.argmax(dim=-1)

    def _take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def _warn_full(self) -> None:
        if not self._warned_full:
            self._warned_full = True
            logger.warning(
                "the draft model's KV cache is full (%d blocks): requests that do not fit get no proposals until "
                "others finish (logged once)",
                self.pool.num_blocks,
            )


def check_same_vocabulary(
    target: tuple[str, ModelConfig, Tokenizer], draft: tuple[str, ModelConfig, Tokenizer]
) -> None:
    """Refuse a draft whose tokens are not the target's: ``EngineStartupError`` naming both models and what differs.

    The tokenizers must map the same strings to the same ids (every token, a probe text) and agree on BOS and EOS.
    The models' vocab sizes may differ only past the tokenizer's tokens (padding rows, as in a family whose small
    models pad less): the draft then proposes only ids the target has.
    """
    (target_name, target_config, target_tokenizer) = target
    (draft_name, draft_config, draft_tokenizer) = draft
    differences = _vocabulary_differences(target_tokenizer, draft_tokenizer)
    shared = min(target_tokenizer.vocab_size, draft_tokenizer.vocab_size)
    for name, config in (("target", target_config), ("draft", draft_config)):
        if config.vocab_size < shared:
            differences.append(
                f"the {name} model has {config.vocab_size} token ids, fewer than the {shared} of its tokenizer"
            )
    if differences:
        raise EngineStartupError(
            f"speculative_config's draft model {draft_name!r} does not share the vocabulary of the model "
            f"{target_name!r}: {'; '.join(differences)}. A draft model must use the target's tokenizer "
            "(a smaller model of the same family).",
            phase="model load",
        )


def _vocabulary_differences(target: Tokenizer, draft: Tokenizer) -> list[str]:
    differences = []
    if target.vocab_size != draft.vocab_size:
        differences.append(
            f"tokenizers of {target.vocab_size} (target) and {draft.vocab_size} (draft) tokens"
        )
    target_table, draft_table = _token_table(target), _token_table(draft)
    if (target_table is None) != (draft_table is None):
        differences.append("one tokenizer is the built-in byte-level one, the other is not")
    elif target_table is not None and draft_table is not None and target_table != draft_table:
        by_id = {token_id: token for token, token_id in draft_table.items()}
        for token, token_id in sorted(target_table.items(), key=lambda item: item[1]):
            other = by_id.get(token_id)
            if other != token:
                differences.append(f"token id {token_id} is {token!r} (target) and {other!r} (draft)")
                break
        else:
            differences.append("the draft's tokenizer has tokens the target's has not")
    for name, ours, theirs in (
        ("BOS", target.bos_token_id, draft.bos_token_id),
        ("EOS", target.eos_token_id, draft.eos_token_id),
    ):
        if ours is not None and theirs is not None and ours != theirs:
            differences.append(f"{name} token id {ours} (target) and {theirs} (draft)")
    if not differences:
        ours, theirs = target.encode(PROBE_TEXT), draft.encode(PROBE_TEXT)
        if ours != theirs:
            differences.append(f"the same text encodes to other ids ({ours[:8]}... and {theirs[:8]}...)")
    return differences


def _token_table(tokenizer: Tokenizer) -> dict[str, int] | None:
    """Every token's string and id (``None`` for the built-in byte-level tokenizer, whose table is fixed)."""
    backend = getattr(tokenizer, "backend", None)
    return backend.get_vocab(with_added_tokens=True) if backend is not None else None
