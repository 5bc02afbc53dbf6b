"""Every message that crosses a process boundary, as msgspec Structs in one tagged union.

Each Struct is encoded as a msgpack array whose first element is its tag, so one decoder per channel knows
what it got; tensors travel as separate zero-copy frames (see ``wire/serial.py``). In-process mode passes the
same objects to the engine core directly. The channels:

==============================  ===========================  =============================================
channel                         direction                    messages
==============================  ===========================  =============================================
ROUTER -> DEALER (input)        front end -> engine          ``EngineRequest``: add, abort, utility,
                                                             shutdown, wakeup
PUSH -> PULL (output)           engine -> front end          ``EngineOutput``: outputs, dead
DEALER -> ROUTER (handshake)    engine -> front end          ``StartupReport``: phase, ready
stdin pipe                      front end -> engine process  ``EngineProcArgs`` (length-prefixed, once)
DEALER -> ROUTER (watch)        remote rank <-> front end    ``RankMessage``: hello (the join, with the
                                                             wire version), exit; ``JoinReply``: accepted,
                                                             refused
keys file                       front end -> remote rank     ``RemoteRankKeys`` (JSON, copied by the user)
unix socketpair                 front end <-> launcher       ``LauncherRequest`` / ``LauncherReply``
==============================  ===========================  =============================================
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec
import torch

from enginekit.config import EngineConfig
from enginekit.lora_request import LoRARequest
from enginekit.sampling_params import SamplingParams

__all__ = [
    "AbortRequest",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineDead",
    "EngineOutput",
    "EngineProcArgs",
    "EngineRequest",
    "ExecutorFailed",
    "FinishReason",
    "InvalidRequest",
    "JoinAccepted",
    "JoinHeader",
    "JoinRefused",
    "JoinReply",
    "LegacyRankJoin",
    "PhaseReport",
    "RankExit",
    "RankJoin",
    "RankMessage",
    "ReadyMessage",
    "RemoteRankKeys",
    "RequestError",
    "RequestStatus",
    "ShutdownRequest",
    "StartupReport",
    "TensorParallelWorkerArgs",
    "UtilityOutput",
    "UtilityRequest",
    "WakeupRequest",
]

_MESSAGE = {"array_like": True, "omit_defaults": True, "gc": False}
# What the engine accepts from a socket is strict: a message with extra fields is malformed, not truncated.
_REQUEST = {**_MESSAGE, "forbid_unknown_fields": True}


class RequestStatus(enum.IntEnum):
    """Where a request is in the engine; an output reports a change of it."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted, rejected, or failed validation (then ``EngineCoreOutput.error`` says why)


# ---- front end -> engine ---------------------------------------------------------------------------------


class RequestError(msgspec.Struct, **_MESSAGE):
    """Why the engine refused a request: the exception the front end raises for it."""

    kind: Literal["ValueError", "TypeError"]
    message: str


class EngineCoreRequest(msgspec.Struct, tag="add", **_REQUEST):
    """Add a request (already tokenized).

    ``parent_request_id`` groups the ``n`` samples of one prompt: the engine prefills one of them first, so the
    others find the prompt's blocks in the prefix cache. ``final_only``: the caller wants only the end (a
    ``generate`` nothing watches live), so the engine sends one output when the request ends, with every token,
    instead of a delta per step (and its status changes, which are rare). ``lora_request``: the LoRA adapter the
    request runs with (the engine loads it from its folder the first time).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    prompt_embeds: torch.Tensor | None = None
    parent_request_id: str | None = None
    final_only: bool = False
    lora_request: LoRARequest | None = None


class AbortRequest(msgspec.Struct, tag="abort", **_REQUEST):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="utility", **_REQUEST):
    """Call ``EngineCore.utility_<method_name>(*args)``; answered by a ``UtilityOutput`` with ``call_id``."""

    call_id: int
    method_name: str
    args: list[Any] = []


class ShutdownRequest(msgspec.Struct, tag="shutdown", **_REQUEST):
    """Stop taking work: abort every request now (``timeout == 0``) or let them finish up to ``timeout``."""

    timeout: float = 0.0


class WakeupRequest(msgspec.Struct, tag="wakeup", **_REQUEST):
    """Does nothing; unblocks a loop waiting on its input queue."""


class ExecutorFailed(msgspec.Struct, tag="executor_failed", **_MESSAGE):
    """Internal only (never accepted from a socket): the executor failed and the engine must die."""

    reason: str = ""


class InvalidRequest(msgspec.Struct, tag="invalid", **_MESSAGE):
    """Internal only: an ADD the engine could not decode; the engine answers its id with ``error``."""

    request_id: str
    error: RequestError


EngineRequest = EngineCoreRequest | AbortRequest | UtilityRequest | ShutdownRequest | WakeupRequest


# ---- engine -> front end ---------------------------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, **_MESSAGE):
    """What one step produced for one request: a delta, not the cumulative output (for a ``final_only`` request,
    the one output it gets: everything, when it ends)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # [num_new_tokens, k + 1] log-probabilities, token ids and ranks: the sampled token first, then the top k.
    logprob_values: torch.Tensor | None = None
    logprob_token_ids: torch.Tensor | None = None
    logprob_ranks: torch.Tensor | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None
    # Sent once, with the request's first token: [num_prompt_tokens - 1, k + 1], the prompt token at each
    # position first, then the top k (there is nothing to score the first prompt token against).
    prompt_logprob_values: torch.Tensor | None = None
    prompt_logprob_token_ids: torch.Tensor | None = None
    prompt_logprob_ranks: torch.Tensor | None = None
    # A change of the request's status (scheduled, preempted), with the engine's timing of it.
    status: RequestStatus | None = None
    first_scheduled_time: float = 0.0
    num_preemptions: int = 0
    # A final_only request's one output: when the engine produced its first token (no delta told the front end).
    first_token_time: float = 0.0
    # Speculative decoding, so far (on the outputs of a request that has any): its proposals verified, of them
    # accepted, and the forced tokens of its structured output taken without sampling.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forced_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, **_MESSAGE):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", **_MESSAGE):
    """One batch from one engine: the deltas of a step and the utility answers that came with it."""

    outputs: list[EngineCoreOutput] = []
    utility_outputs: list[UtilityOutput] = []
    engine_index: int = 0


class EngineDead(msgspec.Struct, tag="dead", **_MESSAGE):
    """The engine process is dying of an error, or stopping for a signal it was sent (``signal_name``, e.g.
    ``"SIGTERM"``) rather than for the front end's shutdown; sent once, last."""

    reason: str = ""
    engine_index: int = 0
    signal_name: str | None = None


EngineOutput = EngineCoreOutputs | EngineDead

# An engine repeats its EngineDead on stderr as it sends it: over IPC, libzmq drops a message still in the
# kernel's buffer when the engine hangs up while the front end's queue is full (see client/receiver.py), and the
# front end then finds the reason in the output it keeps of the process (``last_words``).
LAST_WORDS = "enginekit engine dead: "


def last_words_line(message: EngineDead) -> str:
    """The stderr line that repeats ``message``."""
    return LAST_WORDS + msgspec.json.encode(message).decode()


def last_words(output: str) -> EngineDead | None:
    """The ``EngineDead`` an engine's output repeats last, if any."""
    for line in reversed(output.splitlines()):
        if line.startswith(LAST_WORDS):
            try:
                return msgspec.json.decode(line[len(LAST_WORDS) :], type=EngineDead)
            except msgspec.DecodeError:
                return None
    return None


# ---- engine -> front end during startup --------------------------------------------------------------------


class PhaseReport(msgspec.Struct, tag="phase", **_MESSAGE):
    """The startup phase the engine process has entered (named if startup fails)."""

    phase: str


class ReadyMessage(msgspec.Struct, tag="ready", **_MESSAGE):
    """The handshake: sent once, after the model and KV cache are ready."""

    max_model_len: int
    num_gpu_blocks: int
    kv_cache_size_tokens: int
    block_size: int
    pid: int
    device: str
    engine_index: int = 0
    kv_cache_bytes: int = 0  # the KV tensors' size: blocks x bytes per block
    # The loaded model's config (``ModelConfig``'s fields): the front end checks it is the model it tokenizes for.
    model: dict[str, Any] | None = None


StartupReport = PhaseReport | ReadyMessage


class EngineProcArgs(msgspec.Struct, **_MESSAGE):
    """Everything the engine process needs, written by the front end on its stdin."""

    config: EngineConfig
    input_address: str
    output_address: str
    engine_index: int = 0
    curve_server_public: bytes = b""
    curve_client_public: bytes = b""
    curve_client_secret: bytes = b""

    @property
    def identity(self) -> bytes:
        """The engine's routing identity on the front end's ROUTER socket."""
        return engine_identity(self.engine_index)


class TensorParallelWorkerArgs(msgspec.Struct, **_MESSAGE):
    """What a tensor-parallel worker needs, written by rank 0 (the engine core's process) on its stdin; the
    step headers follow on the same pipe (``enginekit.model.parallel.HEADER``), and EOF means rank 0 died."""

    config: EngineConfig
    rank: int
    size: int
    store_port: int
    device: str
    num_threads: int
    engine_index: int = 0
    progress_fd: int = -1  # the ``ProgressBoard``'s memfd, inherited: the worker counts its collectives there


def engine_identity(engine_index: int) -> bytes:
    return b"engine-%d" % engine_index


# ---- remote ranks: an engine started by hand elsewhere joins the front end ---------------------------------


class RemoteRankKeys(msgspec.Struct, forbid_unknown_fields=True):
    """The keys file: what a remote rank needs to reach its front end (written as JSON, mode 0600).

    The CURVE keys are Z85 text. The host is the one the front end bound; a remote rank may be told another
    name for the same machine.
    """

    host: str
    input_port: int
    output_port: int
    watch_port: int
    curve_server_public: str
    curve_server_secret: str
    curve_client_public: str
    curve_client_secret: str


class RankJoin(msgspec.Struct, tag="hello", **_REQUEST):
    """A remote rank asks for its arguments, on the watch socket, whose connection then tells its liveness.

    It opens with the wire version the rank speaks (``wire/version.py``): the front end reads those first
    three fields alone (``JoinHeader``) and refuses a peer of another version before decoding the rest. They
    must never change."""

    protocol: int
    schema: str
    rank: int
    pid: int
    hostname: str


class JoinHeader(msgspec.Struct, tag="hello", array_like=True):
    """The first fields of any release's ``RankJoin``: decodes whatever follows them (another version's)."""

    protocol: int
    schema: str
    rank: int


class LegacyRankJoin(msgspec.Struct, tag="join", array_like=True):
    """The join of the releases before the wire had a version (protocol 1): recognised, to refuse it clearly."""

    rank: int
    pid: int = 0
    hostname: str = ""


class RankExit(msgspec.Struct, tag="exit", **_REQUEST):
    """A remote rank's engine failed: its exit code and the tail of its log, sent before it hangs up."""

    code: int
    error_tail: str


RankMessage = RankJoin | RankExit


class JoinAccepted(msgspec.Struct, tag="accepted", **_MESSAGE):
    args: EngineProcArgs


class JoinRefused(msgspec.Struct, tag="refused", **_MESSAGE):
    """The one reply every release decodes (a peer of another version gets it): never change it."""

    reason: str
    retry: bool = False  # the rank may ask again later (the front end is busy with another incarnation)


JoinReply = JoinAccepted | JoinRefused


# ---- front end <-> launcher --------------------------------------------------------------------------------


class SpawnRequest(msgspec.Struct, tag="spawn", **_MESSAGE):
    """Fork an engine process; its stdin and output pipes travel beside this message as file descriptors.

    The child takes the front end's environment, working directory and ``sys.path`` at the time of the call,
    so that an engine forked by the launcher behaves exactly like one the front end would have spawned.
    """

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]


class StatusRequest(msgspec.Struct, tag="status", **_MESSAGE):
    pid: int


class ForgetRequest(msgspec.Struct, tag="forget", **_MESSAGE):
    pid: int


class Spawned(msgspec.Struct, tag="spawned", **_MESSAGE):
    pid: int


class ExitStatus(msgspec.Struct, tag="exit_status", **_MESSAGE):
    """``returncode`` is ``None`` while running, else the exit code (negative: killed by that signal)."""

    pid: int
    returncode: int | None = None


class LauncherFailure(msgspec.Struct, tag="failure", **_MESSAGE):
    message: str


class LauncherReady(msgspec.Struct, tag="launcher_ready", **_MESSAGE):
    pid: int


LauncherRequest = SpawnRequest | StatusRequest | ForgetRequest
LauncherReply = Spawned | ExitStatus | LauncherFailure | LauncherReady
