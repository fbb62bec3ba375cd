"""What crosses the process boundary: a prompt's job, its outcome, and the parent <-> worker messages.

One frozen dataclass per kind, pickled as they are. A worker introduces itself with :class:`Ready`
(how many prompts it runs at once); the parent then sends it one :class:`PromptJob` at a time, on
the worker's own connection, whenever it has a free slot. A worker sends back a :class:`Log` line
per tool call (``--verbose``), exactly one :class:`Outcome` (or :class:`Skipped`) per job (which
frees its slot), :class:`StopQueued` / :class:`StopDone` around each background sandbox stop,
:class:`Spend` per answered model call when the run has a budget (without one, the outcome's usage
is the spend: one :class:`Spend` only for the first call whose usage cannot be trusted, so that the
parent warns at once), and :class:`Pause` when the endpoint
said 429. The parent sends :class:`PauseAll` (the whole run backs off) and :class:`StopStarting`
(the budget is spent). The inbox wraps what a worker sends in :class:`Received`, with the
worker's id, and adds :class:`WorkerExit` when a connection ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.identity import RowIdentity, RowOptions  # RowOptions: re-exported with the messages

TRAJECTORY, DISCARDED, FAILED = "trajectory", "discarded", "failed"
SKIPPED_AFTER_PASSES = "skipped_after_passes"  # a discard reason: the row had --stop_after_passes passes


@dataclass(frozen=True, slots=True)
class RowCheck:
    """How a dataset row's samples are judged (``batchrun.scoring``): its expected answer, its verify
    commands and hidden files, its rubric. Not part of the row's identity. Slotted: held by its row for
    the whole run (112 bytes with a ``__dict__``, 72 without)."""

    answer: Any = None  # a string, a number, or a tuple of acceptable strings
    verify: tuple[str, ...] = ()  # shell commands run in the sandbox after the last turn
    verify_files: tuple[tuple[str, str], ...] = ()  # (path, text), written only after the last turn
    rubric: str | None = None  # instructions for a model judge

    def is_empty(self) -> bool:
        return self == RowCheck()


@dataclass(frozen=True, slots=True)
class PromptJob:
    """One row to run, as the parent schedules it. Slotted: the plan holds every job for the whole run
    (200 bytes each with a ``__dict__``, 144 without)."""

    batch_num: int
    prompt_index: int
    prompt: str
    toolsets: tuple[str, ...]  # sampled by the parent, so they are fixed before any work starts
    image: str | None = None
    cwd: str | None = None
    fail_reason: str | None = None  # set by preflight: the prompt fails without calling the model
    row_fields: str | None = None  # the dataset row's other fields, as JSON text (metadata.row_fields)
    row_id: str | None = None  # the dataset row's ``id`` as a string (metadata.row_id)
    toolsets_sampled: tuple[str, ...] | None = None  # what the distribution drew, before availability
    options: RowOptions = RowOptions()  # the row's own toolsets, tools, system prompt, max_turns
    sample_index: int = 0  # which of the row's samples (--samples_per_prompt) this job is, from 0
    occurrence: int = 0  # how many earlier dataset rows hold the same prompt text (request seeds differ)
    check: RowCheck | None = None  # the row's answer / verify / verify_files / rubric (None: none)


@dataclass(frozen=True)
class Outcome:
    """How one attempted prompt ended: a trajectory, a discard (with its reason) or a failure."""

    kind: str  # TRAJECTORY, DISCARDED or FAILED
    batch_num: int
    prompt_index: int
    identity: RowIdentity  # the row's (unredacted): resume, merge and --stop_after_passes find it by its key
    usage: dict[str, Any]  # Usage.as_dict(): what this attempt spent, whatever its end
    record: dict[str, Any] | None = None  # trajectories and discards
    reason: str | None = None  # discards: which quality filter
    error_class: str | None = None  # failures: what kind of failure
    error: str | None = None  # failures: the message (and a discard without a record: why)
    sample_index: int = 0
    row_id: str | None = None  # the dataset row's ``id`` (failed and discarded rows carry it too)
    row_fields: str | None = None  # the dataset row's other fields, as JSON text
    occurrence: int = 0  # the job's: how many earlier dataset rows held the same prompt text

    @property
    def prompt(self) -> str:
        return self.identity.text

    @property
    def image(self) -> str | None:
        return self.identity.image

    @property
    def cwd(self) -> str | None:
        return self.identity.cwd

    @classmethod
    def trajectory(cls, job: PromptJob, record: dict[str, Any], usage: dict[str, Any]) -> Outcome:
        return cls(TRAJECTORY, **_of_job(job), usage=usage, record=record)

    @classmethod
    def discarded(
        cls,
        job: PromptJob,
        reason: str,
        record: dict[str, Any] | None,
        usage: dict[str, Any],
        error: str | None = None,
    ) -> Outcome:
        return cls(DISCARDED, **_of_job(job), usage=usage, record=record, reason=reason, error=error)

    @classmethod
    def failed(
        cls, job: PromptJob, error_class: str, error: str, usage: dict[str, Any] | None = None
    ) -> Outcome:
        return cls(FAILED, **_of_job(job), usage=usage or {}, error_class=error_class, error=error)


def _of_job(job: PromptJob) -> dict[str, Any]:
    """What an outcome takes from its job: where it belongs, the row's identity, its id and fields."""
    return {
        "batch_num": job.batch_num,
        "prompt_index": job.prompt_index,
        "identity": RowIdentity.of_job(job),
        "sample_index": job.sample_index,
        "row_id": job.row_id,
        "row_fields": job.row_fields,
        "occurrence": job.occurrence,
    }


# -- worker -> parent


@dataclass(frozen=True)
class Ready:
    """A worker is up and runs ``slots`` prompts at once: the parent hands it that many, then one per outcome."""

    slots: int


@dataclass(frozen=True)
class Skipped:
    """A prompt not started because the run is stopping (budget): left for a later --resume."""

    batch_num: int
    prompt_index: int
    sample_index: int = 0


@dataclass(frozen=True)
class Log:
    """One tool call of a prompt, for --verbose (redacted and cut by the parent)."""

    prompt_index: int
    tool: str
    args: str
    result: str


@dataclass(frozen=True)
class Spend:
    """One answered model call of a prompt still in flight: the parent holds the run's budget to it at once
    (sent per call only with a run-wide budget; see batchrun/run/worker.py's ``report_unbudgeted``)."""

    batch_num: int
    prompt_index: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    sample_index: int = 0
    reservation: int | None = None  # the Reserve this call was sent under: freed now
    fault: str | None = None  # what was wrong with the endpoint's usage (then the counts are estimates)
    priced: bool = True  # the answer reported its cost (usage.cost); False: --budget_usd must estimate it
    unanswered_tokens: int = 0  # a failed attempt that may have been billed: its estimated tokens
    cached_tokens: int = 0  # of prompt_tokens: read from the endpoint's prompt cache
    cache_write_tokens: int = 0  # of prompt_tokens: written to it


@dataclass(frozen=True)
class Reserve:
    """A model call of this worker may spend up to ``tokens``: may it be sent? (the budget, see batchrun/run/budget.py)"""

    rid: int
    tokens: int
    priority: int = 0  # the calls its prompt has made: a prompt under way goes first
    prompt: tuple[int, int, int] | None = (
        None  # (batch, prompt index, sample index); None: not a prompt's call
    )
    model: str | None = None  # the model asked (a judge's, a tool's): --budget_usd learns each one's price


@dataclass(frozen=True)
class EndpointHealth:
    """After a model call's attempt: whether it failed for the endpoint's reasons (refused, reset,
    timed out, 5xx: ``error_class``) or answered (None). The parent watches for a dead endpoint.
    ``judge``: the call was the judge's (--scorer=judge), whose endpoint has its own watch. ``refused``:
    the call's final error refused the key or the account (batchrun.prompt.llm.refused), not a fault.
    ``sent_at``: ``time.time()`` as the call went out (None: not known)."""

    error_class: str | None
    judge: bool = False
    refused: bool = False
    sent_at: float | None = None


@dataclass(frozen=True)
class Pause:
    """The endpoint said 429 to this worker: the whole run should back off until ``until`` (epoch s)."""

    until: float


@dataclass(frozen=True)
class StopQueued:
    """A sandbox stop was queued in the background (sent just before its prompt's outcome)."""


@dataclass(frozen=True)
class StopDone:
    """A background sandbox stop finished."""


# -- parent -> worker


@dataclass(frozen=True)
class PauseAll:
    """Back off from the endpoint until ``until`` (epoch seconds), as one worker was told to. ``lift``:
    the pause up to ``until`` is over now (the dead-endpoint watch's, once the endpoint answers again)."""

    until: float
    lift: bool = False


@dataclass(frozen=True)
class Grant:
    """The answer to a :class:`Reserve`: send the call, or not (the budget is reached)."""

    rid: int
    ok: bool


@dataclass(frozen=True)
class StopStarting:
    """Start no new prompt (the budget is spent); prompts in flight end at their next model call."""


# -- what the parent's inbox yields


@dataclass(frozen=True)
class Received:
    """A message from worker ``pid`` (an id unique across machines for Ray workers)."""

    pid: int | None
    message: Any


@dataclass(frozen=True)
class WorkerExit:
    """Worker ``pid``'s connection ended: it died or was ended."""

    pid: int | None
