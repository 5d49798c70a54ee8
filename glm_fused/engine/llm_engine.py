"""The generation engine. Rank 0 schedules, broadcasts each step, runs the model and samples
on its device; the other ranks run the model on what rank 0 sends (``run_worker``).

Every step travels as one int64 array, ``[command, *sampling.to_array(), *batch.to_array()]``,
through the backend's ``broadcast_int64`` on the global group. All ranks then take part in
the same forward (its all-reduces, the gather of the logits to rank 0, the broadcast of the
sampled tokens). While idle, rank 0 sends a no-op now and then so the waiting ranks never sit
in one collective long enough to hit the process group's timeout.

The step is overlapped (as SGLang's overlap scheduler and vLLM's async scheduling are): step
N+1 is scheduled and launched before step N's tokens reach the host, its decode inputs being
placeholders the runner fills on the device with step N's samples. Then step N's tokens are
collected (detokenized, checked for stop conditions, streamed) while step N+1 runs. A sequence
that turns out to have stopped at step N has one wasted row in step N+1, which is dropped.

Not for every sequence: a grammar's mask for step N+1 depends on step N's token (the grammar
advances on the host when the token is collected), and penalties count the tokens made. Such
a sequence never gets a step while its token is in flight (``Sequence.waits_for_host``), and
when step N holds one, the engine collects step N before it schedules step N+1: the grammar
sequence goes at full speed, and the batch it shares runs without overlap while it does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from glm_fused.batch import ForwardBatch
from glm_fused.engine.sampling import InvalidParam, SampleRow, SamplingBatch, SamplingParams, derive_seed, row_key
from glm_fused.engine.scheduler import Scheduler
from glm_fused.engine_args import EngineArgs
from glm_fused.engine.sequence import Sequence

# CMD_PING: a no-op the other ranks answer with a barrier, so an idle rank 0 notices a rank
# that stopped answering (its engine watchdog sees the barrier hang).
CMD_STOP, CMD_FORWARD, CMD_NOOP, CMD_PING = 0, 1, 2, 3


@dataclass
class RequestOutput:
    """What one step did for one request (its new token, text delta, and whether it ended)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seq: Sequence  # read-only view for timings and full results (logprobs: seq.output_logprobs)


def check_prompt(prompt_token_ids, params: SamplingParams, *, max_model_len: int,
                 vocab_size: int | None, param: str = "prompt", max_tokens_given: bool = True) -> np.ndarray:
    """The prompt's ids as one int64 array (the same array if it is one), or InvalidParam
    when a request cannot fit; ``param`` names the prompt field.

    A module function as well as an engine method: the server's preprocessing workers check
    prompts before they reach the engine (``glm_fused.server.preprocess``), and hand the
    engine this array: a long prompt's ids are turned into an array once (2,080 ids: 0.07 ms).
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidParam(param, f"{param} is empty")
    try:
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
    except OverflowError:  # an id beyond int64
        ids = None
    if vocab_size is not None:
        if ids is not None:
            bad = [int(t) for t in ids[(ids < 0) | (ids >= vocab_size)][:1]]
        else:
            bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab_size][:1]
        if bad:
            raise InvalidParam(param, f"{param} has token id {bad[0]} outside the vocabulary "
                                      f"(0..{vocab_size - 1})")
    if ids is None:
        raise InvalidParam(param, f"{param} has a token id that does not fit in 64 bits")
    if n >= max_model_len:
        raise InvalidParam(param, f"{param} has {n} tokens; this server's context limit "
                                  f"(--max-model-len) is {max_model_len}, leaving no room to generate",
                           code="context_length_exceeded")
    if max_tokens_given and n + params.max_tokens > max_model_len:
        raise InvalidParam("max_tokens", f"max_tokens={params.max_tokens} plus the {n} prompt tokens "
                                         f"exceeds the context limit of {max_model_len} tokens",
                           code="context_length_exceeded")
    return ids


class LLMEngine:
    """Continuous-batching engine over a ModelRunner (``forward(ForwardBatch) -> logits``).

    Not thread-safe: one thread calls ``add_request`` / ``abort`` / ``step``. The server
    feeds it through a queue; ``generate`` drives it offline.
    """

    def __init__(self, runner, args: EngineArgs, *, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] = (), tokenizer=None,
                 broadcast: Callable[[np.ndarray], object] | None = None,
                 barrier: Callable[[], object] | None = None,
                 heartbeat_s: float = 2.0):
        self.runner = runner
        self.scheduler = Scheduler(args)
        self.max_model_len = args.max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer  # glm_fused.tokenizer.Tokenizer (or anything with decode): text output
        self.broadcast = broadcast
        self.barrier = barrier  # given: idle heartbeats are pings (the workers pass barrier to run_worker)
        self.heartbeat_s = heartbeat_s
        self.seqs: dict[str, Sequence] = {}
        self.seed = args.seed            # unseeded requests' seeds derive from it and a counter
        self.max_logprobs = args.max_logprobs
        self._requests = 0
        self._inflight = None  # (ScheduledStep, callable giving its tokens) launched, not yet collected
        self._last_broadcast = time.monotonic()
        self._stopped = False
        # Running totals (read by the server's /metrics).
        self.num_steps = 0
        self.num_forward_tokens = 0
        self.forward_seconds = 0.0
        # Decode-only steps (every sequence one token): how many, and their forward + LM head as
        # the device ran them. Their ratio is the time per output token the engine is held to.
        self.num_decode_steps = 0
        self.decode_device_seconds = 0.0
        self.device_seconds = 0.0  # the same, over every step
        self._untimed: list = []  # prompt chunks' results, timed with the next step that returns tokens
        self.fusion_totals: dict[str, int] = {}

    # ---- requests ------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids, params: SamplingParams,
                     param: str = "prompt", max_tokens_given: bool = True) -> np.ndarray:
        """The ids as an int64 array, or InvalidParam when a request cannot fit; ``param``
        names the prompt field."""
        return check_prompt(prompt_token_ids, params, max_model_len=self.max_model_len,
                            vocab_size=self.vocab_size, param=param, max_tokens_given=max_tokens_given)

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams,
                    arrival_time: float | None = None, grammar=None) -> Sequence:
        """``prompt_token_ids``: a list of ints or an int64 array (the server sends the one
        its checks made); ``grammar``: a ``GrammarState`` the output must follow (structured output)."""
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt_token_ids = self.check_prompt(prompt_token_ids, params)  # one array for the checks and the sequence
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.max_logprobs:
                raise InvalidParam(name, f"{name}={n}: this server returns at most {self.max_logprobs} "
                                         f"(--max-logprobs)")
        if self.vocab_size is not None:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise InvalidParam("logit_bias", f"logit_bias: token id {bad[0]} is outside the vocabulary "
                                                 f"(0..{self.vocab_size - 1})")
        detok = self.tokenizer.text_stream(params.skip_special_tokens) if self.tokenizer is not None else None
        self._requests += 1
        seed = params.seed if params.seed is not None else derive_seed(self.seed, self._requests)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq = Sequence(request_id, prompt_token_ids, params, detokenizer=detok, arrival_time=arrival_time,
                       max_len=self.max_model_len, sampling_seed=seed, grammar=grammar, stop_ids=stops)
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Drop a request (client gone, shutdown); its KV-cache blocks are free for the next step."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        return self._output(seq, [])

    def abort_all(self, reason: str = "abort") -> list[RequestOutput]:
        return [out for rid in list(self.seqs) if (out := self.abort(rid, reason)) is not None]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def kv_cache_stats(self) -> dict:
        """The KV cache in plain numbers: ``num_blocks``, ``block_size``, ``usage`` (fraction of
        blocks held by sequences), ``prefix_caching`` (on/off), ``prefix_cache_queries`` and
        ``prefix_cache_hits`` (tokens looked up / found cached, running totals),
        ``num_preemptions`` (running total). Safe to read from another thread."""
        return self.scheduler.kv_cache_stats()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next forward (with its sampling), then collect the previous one's tokens,
        which reached the host while this one runs on the device. When the previous step holds
        a sequence that waits for its token on the host (grammar, penalties), collect it first."""
        outputs = []
        if self._inflight is not None and any(seq.waits_for_host and not seq.finished
                                              for seq, sampled in zip(self._inflight[0].seqs,
                                                                      self._inflight[0].sample) if sampled):
            outputs = self._collect(*self._inflight)
            self._inflight = None
        step = self.scheduler.schedule()
        launched = None
        if step is not None:
            sampling, scored = self._sampling(step)
            if self.broadcast is not None:  # the other ranks' copy of the step (built only for them)
                self._send(CMD_FORWARD, np.concatenate([sampling.to_array(), step.batch.to_array()]))
            start = time.perf_counter()
            result = self.runner.execute(step.batch, sampling, sample=sampling.num_rows > 0)
            self.forward_seconds += time.perf_counter() - start
            self.num_steps += 1
            self.num_forward_tokens += step.num_tokens
            self._add_fusion_stats()
            self.scheduler.commit(step)
            launched = (step, result, scored)
        if self._inflight is not None:
            outputs += self._collect(*self._inflight)
        self._inflight = launched
        return outputs

    def _sampling(self, step) -> tuple[SamplingBatch, list[tuple[Sequence, int]]]:
        """The step's ``SamplingBatch`` (no rows: prompt chunks only), and which sequences'
        prompt tokens it scores (echo): (sequence, rows) in row order."""
        rows, prompt_rows, targets, scored, top_n = [], [], [], [], 0
        for seq, n, sampled, offset in zip(step.seqs, step.num_new, step.sample, step.batch.seq_starts):
            p = seq.params
            if p.prompt_logprobs is not None and seq.in_prefill:
                # Position i's logits score prompt token i + 1; the last prompt position's are
                # the first sample's.
                # Positions already scored (a prompt computed again) are not scored twice.
                first = seq.num_computed
                start, end = max(first, len(seq.prompt_logprobs) - 1), min(first + n, seq.prompt_len - 1)
                if end > start:
                    prompt_rows.extend(range(int(offset) + start - first, int(offset) + end - first))
                    targets.extend(seq.prompt_token_ids[start + 1:end + 1])
                    scored.append((seq, end - start))
                    top_n = max(top_n, p.prompt_logprobs)
            if not sampled:
                continue
            index = seq.next_sample_index
            rows.append(SampleRow(
                p, row_key(seq.sampling_seed, index), num_output=index,
                stop_ids=seq.stop_ids if seq.grammar is None else (),  # the grammar says when to stop
                prompt_ids=seq.prompt_token_ids if p.penalized else (),
                output_ids=seq.output_token_ids if p.penalized else (),
                bitmask=seq.grammar.next_bitmask() if seq.grammar is not None else None))
        return SamplingBatch.build(rows, prompt_rows=prompt_rows, prompt_targets=targets,
                                   prompt_logprobs=top_n), scored

    def _collect(self, step, result, scored) -> list[RequestOutput]:
        start = time.perf_counter()
        out = result()  # waits for that step's results only
        self.forward_seconds += time.perf_counter() - start
        if getattr(result, "timed", False):
            if out is None:  # a prompt chunk: timed once a later step's results are in (no wait here)
                self._untimed.append(result)
            else:
                self.device_seconds += sum(r.device_seconds for r in self._untimed) + result.device_seconds
                self._untimed.clear()
                if bool((step.batch.query_lens == 1).all()):
                    self.num_decode_steps += 1
                    self.decode_device_seconds += result.device_seconds
        if scored and out is not None and out.prompt_logprobs is not None:
            chosen, ids, values = out.prompt_logprobs
            at = 0
            for seq, n in scored:
                k = seq.params.prompt_logprobs
                seq.prompt_logprobs.extend((float(chosen[i]), ids[i, :k].tolist(), values[i, :k].tolist())
                                           for i in range(at, at + n))
                at += n
        outputs, row = [], 0
        now = time.monotonic()
        for seq, sampled in zip(step.seqs, step.sample):
            if not sampled:
                continue
            token = int(out.tokens[row])
            row += 1
            if seq.finished:  # aborted, or stopped at the step before: this row was a spare
                continue
            seq.num_inflight -= 1
            if seq.params.logprobs is not None and out.logprobs is not None:
                chosen, ids, values = out.logprobs
                k = seq.params.logprobs
                seq.output_logprobs.append((float(chosen[row - 1]), ids[row - 1, :k].tolist(),
                                            values[row - 1, :k].tolist()))
            seq.append_token(token, self.eos_token_ids, self.max_model_len, now=now)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                self.seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [token]))
        return outputs

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(seq.request_id, new_tokens, seq.take_text_delta(), seq.finished,
                             seq.finish_reason if seq.finished else None, seq.prompt_len,
                             len(seq.output_token_ids), seq)

    def _add_fusion_stats(self) -> None:
        stats_fn = getattr(self.runner, "fusion_stats", None)
        if stats_fn is None:
            return
        for key, value in (stats_fn() or {}).items():
            if isinstance(value, dict):
                for sub, n in value.items():
                    name = f"{key}:{sub}"
                    self.fusion_totals[name] = self.fusion_totals.get(name, 0) + int(n)
            elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                self.fusion_totals[key] = self.fusion_totals.get(key, 0) + int(value)

    # ---- the other ranks -----------------------------------------------------------------
    def _send(self, cmd: int, payload: np.ndarray | None = None) -> None:
        if self.broadcast is None:
            return
        head = np.array([cmd], dtype=np.int64)
        self.broadcast(head if payload is None else np.concatenate([head, payload]))
        self._last_broadcast = time.monotonic()

    def heartbeat(self) -> None:
        """Call while idle: keeps the waiting ranks' broadcast from timing out, and with a
        barrier makes it a round trip that every rank must answer."""
        if self.broadcast is not None and time.monotonic() - self._last_broadcast >= self.heartbeat_s:
            if self.barrier is None:
                self._send(CMD_NOOP)
            else:
                self._send(CMD_PING)
                self.barrier()

    def stop_workers(self) -> None:
        """Tell the other ranks to leave ``run_worker`` (once)."""
        if not self._stopped:
            self._stopped = True
            self._send(CMD_STOP)

    # ---- offline -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[Sequence]:
        """Run prompts to completion through the same scheduler the server uses."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"offline-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
        return seqs


def run_worker(runner, broadcast_int64, barrier: Callable[[], object] | None = None) -> int:
    """Loop of every rank but 0: run each forward rank 0 announces, until it says stop.
    ``barrier`` answers rank 0's pings (give it when rank 0's engine has one).

    Returns the number of forwards run.
    """
    steps = 0
    while True:
        msg = broadcast_int64(None, src=0)
        cmd = int(msg[0])
        if cmd == CMD_STOP:
            return steps
        if cmd == CMD_FORWARD:
            sampling, used = SamplingBatch.from_array(msg[1:])
            runner.execute(ForwardBatch.from_array(msg[1 + used:]), sampling, sample=sampling.num_rows > 0)
            steps += 1
        elif cmd == CMD_PING:
            if barrier is None:
                raise RuntimeError("rank 0 pings, but this rank was given no barrier to answer with")
            barrier()
        elif cmd != CMD_NOOP:
            raise RuntimeError(f"rank 0 sent an unknown command {cmd}")
