"""Settings of the optional toolsets (web, vision, image_gen, moa, browser), read from the environment.

A toolset is offered only when its settings are present (``available_toolsets``). A present but
bad value (an unknown provider, a number that is not one) raises :class:`ToolConfigError`
naming the variable, so a run fails at start rather than on its thousandth prompt.

Where settings come from: ``os.environ``, overlaid by :attr:`ToolSettings.tool_env` (a dict of the
same variable names, so a runner or a test can set them without touching the process environment).
The run's own endpoint and directory come from :class:`ToolSettings` too (``ToolContext.settings``),
built once in the parent (``run_tool_settings``) and pickled into each worker.

Variables (``*_S`` are seconds, ``*_BYTES`` bytes, ``*_CHARS`` characters):

web (``web_search`` needs a provider; ``web_extract`` fetches pages itself)
    ``WEB_SEARCH_PROVIDER``  tavily | brave | searxng | exa | firecrawl; unset: the first of these
                             whose key (or ``SEARXNG_URL``) is set. The web toolset is offered only
                             when a provider is configured.
    ``TAVILY_API_KEY``, ``BRAVE_API_KEY``, ``EXA_API_KEY``, ``FIRECRAWL_API_KEY``: the keys.
    ``TAVILY_API_URL``, ``BRAVE_API_URL``, ``EXA_API_URL``, ``FIRECRAWL_API_URL``: base URLs
                             (defaults: the providers' public APIs; a self-hosted Firecrawl needs
                             no key). ``SEARXNG_URL``: the SearXNG instance (JSON format enabled).
    ``WEB_SEARCH_MAX_RESULTS`` (5), ``WEB_TIMEOUT_S`` (30), ``WEB_EXTRACT_MAX_BYTES`` (5000000),
    ``WEB_EXTRACT_MAX_CHARS`` (20000, per page), ``WEB_USER_AGENT``. ``WEB_TIMEOUT_S`` bounds each
                             fetch as a whole (DNS, connections, redirects, headers, body), and apart
                             from it web_extract's conversion of a page to text (a child process,
                             512 MB at most: html_text.HTML_MEMORY_MB).
    ``WEB_ALLOW_PRIVATE_ADDRESSES`` (0): web_extract, vision_analyze, image_generate's download (but
                             for its endpoint's own origin) and the browser run on this host, not in
                             the prompt's sandbox, so by default they refuse URLs whose host resolves to
                             a loopback, private, link-local, multicast, reserved or unspecified
                             address (127.0.0.1, 10.x, 169.254.169.254, ::1, ...), on every redirect
                             hop and for every browser request. 1 lets the model reach them (a
                             trusted local site, tests). The search providers' own URLs are
                             configuration and never checked.

vision (``vision_analyze``; also used by ``browser_vision``)
    ``VISION_BASE_URL`` / ``VISION_API_KEY`` / ``VISION_MODEL``: default to the run's endpoint and
    model. ``VISION_MAX_IMAGE_BYTES`` (10000000), ``VISION_MAX_TOKENS`` (unset), ``VISION_TIMEOUT_S`` (120).

image_gen (``image_generate``; offered only when ``IMAGE_GEN_MODEL`` is set: a chat model cannot draw)
    ``IMAGE_GEN_MODEL``, ``IMAGE_GEN_BASE_URL`` / ``IMAGE_GEN_API_KEY`` (default: the run's endpoint),
    ``IMAGE_GEN_SIZES`` ("landscape=1536x1024,square=1024x1024,portrait=1024x1536"),
    ``IMAGE_GEN_RESPONSE_FORMAT`` (unset | b64_json | url), ``IMAGE_GEN_TIMEOUT_S`` (180),
    ``IMAGE_GEN_MAX_BYTES`` (20000000).

moa (``mixture_of_agents``)
    ``MOA_REFERENCE_MODELS`` (comma-separated; default: the run's model), ``MOA_AGGREGATOR_MODEL``
    (default: the run's model), ``MOA_BASE_URL`` / ``MOA_API_KEY`` (default: the run's endpoint),
    ``MOA_REFERENCE_TEMPERATURE`` (0.6), ``MOA_AGGREGATOR_TEMPERATURE`` (0.4; these two from 0 to 2),
    ``MOA_MAX_TOKENS`` (unset), ``MOA_MIN_SUCCESSFUL`` (1), ``MOA_TIMEOUT_S`` (300).

browser (offered when Playwright is installed and a Chromium binary is found)
    ``BROWSER_EXECUTABLE`` (default: /usr/bin/chromium, else chromium or chromium-browser on PATH),
    ``BROWSER_ENABLED`` (1; 0 turns the toolset off), ``BROWSER_NAV_TIMEOUT_S`` (30),
    ``BROWSER_ACTION_TIMEOUT_S`` (10; these two at most 86400), ``BROWSER_SNAPSHOT_MAX_CHARS`` (8000),
    ``BROWSER_VIEWPORT`` (1280x800; each side at most 8192),
    ``BROWSER_MEMORY_MB`` (2048: the data size, RLIMIT_DATA, each Chromium process may reach; at least 1024).
    Where this process may make cgroups (root, or a delegated v2 subtree: the local sandbox's
    ``limits.cgroup_layout``), each worker's Chromium (every process of it, up to 16 prompts' pages) runs
    in a cgroup of its own: ``BROWSER_CPUS`` (1: cores' worth of CPU time a second; at least 0.1) and
    ``BROWSER_TREE_MEMORY_MB`` (4096: its processes' memory together; at least 1024). A renderer past
    it is killed there by the kernel's OOM killer, never the runner, and the prompt's tab is replaced.
    The browsers of all the run's workers together get at most half this machine's memory (or the
    runner's cgroup's) and half the CPUs the run may use (at least one); a setting above that is
    lowered to it. Measured here: one Chromium with 16 prompts held 1.0 GB on small pages and 2.8 GB
    on pages of 3,000 paragraphs and 200,000 script objects (about 500 threads); opening 16 at once
    took 4.5 s of two cores' time, 11 s within one core; a page spinning in 4 Web Workers took 2 cores.
    Without cgroups only the RLIMIT_DATA above applies, no CPU limit, and the run's start says so.
    ``WEB_ALLOW_PRIVATE_ADDRESSES`` (see web) applies to the browser too.

An endpoint's API key defaults to the run's key only while its base URL is the run's: a key is
never sent to a host it was not given for.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SEARCH_PROVIDERS = ("tavily", "brave", "searxng", "exa", "firecrawl")
_PROVIDER_DEFAULT_URLS = {
    "tavily": "https://api.tavily.com",
    "brave": "https://api.search.brave.com",
    "exa": "https://api.exa.ai",
    "firecrawl": "https://api.firecrawl.dev",
}
_PROVIDER_KEY_VARS = {
    "tavily": "TAVILY_API_KEY",
    "brave": "BRAVE_API_KEY",
    "exa": "EXA_API_KEY",
    "firecrawl": "FIRECRAWL_API_KEY",
}
_PROVIDER_URL_VARS = {
    "tavily": "TAVILY_API_URL",
    "brave": "BRAVE_API_URL",
    "exa": "EXA_API_URL",
    "firecrawl": "FIRECRAWL_API_URL",
    "searxng": "SEARXNG_URL",
}
ASPECT_RATIOS = ("landscape", "square", "portrait")
DEFAULT_IMAGE_SIZES = {"landscape": "1536x1024", "square": "1024x1024", "portrait": "1024x1536"}
# A side of 0 (`square=0x0`) or past what any image endpoint makes was sent with every image_generate
# call, each refused by the endpoint after the model had paid for the call: refused at start instead.
MAX_IMAGE_SIDE = 16384
# The moa toolset's temperatures, bounded as --temperature is (OpenAI's and OpenRouter's range): one of 50
# was sent with each of its model calls, which such an endpoint refuses (400), after the model paid for its turn.
MAX_TEMPERATURE = 2.0
BROWSER_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")


TOOL_ENV_VARS = (
    "WEB_SEARCH_PROVIDER",
    *_PROVIDER_KEY_VARS.values(),
    *_PROVIDER_URL_VARS.values(),
    "WEB_SEARCH_MAX_RESULTS",
    "WEB_TIMEOUT_S",
    "WEB_EXTRACT_MAX_BYTES",
    "WEB_EXTRACT_MAX_CHARS",
    "WEB_USER_AGENT",
    "WEB_ALLOW_PRIVATE_ADDRESSES",
    "VISION_BASE_URL",
    "VISION_API_KEY",
    "VISION_MODEL",
    "VISION_MAX_IMAGE_BYTES",
    "VISION_MAX_TOKENS",
    "VISION_TIMEOUT_S",
    "IMAGE_GEN_MODEL",
    "IMAGE_GEN_BASE_URL",
    "IMAGE_GEN_API_KEY",
    "IMAGE_GEN_SIZES",
    "IMAGE_GEN_RESPONSE_FORMAT",
    "IMAGE_GEN_TIMEOUT_S",
    "IMAGE_GEN_MAX_BYTES",
    "MOA_REFERENCE_MODELS",
    "MOA_AGGREGATOR_MODEL",
    "MOA_BASE_URL",
    "MOA_API_KEY",
    "MOA_REFERENCE_TEMPERATURE",
    "MOA_AGGREGATOR_TEMPERATURE",
    "MOA_MAX_TOKENS",
    "MOA_MIN_SUCCESSFUL",
    "MOA_TIMEOUT_S",
    "BROWSER_EXECUTABLE",
    "BROWSER_ENABLED",
    "BROWSER_NAV_TIMEOUT_S",
    "BROWSER_ACTION_TIMEOUT_S",
    "BROWSER_SNAPSHOT_MAX_CHARS",
    "BROWSER_VIEWPORT",
    "BROWSER_MEMORY_MB",
    "BROWSER_CPUS",
    "BROWSER_TREE_MEMORY_MB",
)
SECRET_ENV_VARS = ("VISION_API_KEY", "IMAGE_GEN_API_KEY", "MOA_API_KEY", *_PROVIDER_KEY_VARS.values())


class ToolConfigError(ValueError):
    """A toolset setting is present but invalid; the message names the variable."""


# ----------------------------------------------------------------------------- reading values


@dataclass(frozen=True)
class ToolSettings:
    """What the optional toolsets need of the run: its endpoint (vision, moa, image_gen default to it),
    its directory (generated images, screenshots) and the tool variables in force."""

    llm_base_url: str | None = None  # the run's OpenAI-compatible base URL (--base_url)
    llm_api_key: str | None = None  # the run's API key: never written to results
    llm_model: str | None = None  # the run's model (--model)
    run_dir: str | None = None  # the run's output directory
    # The parent cgroup of the workers' browsers (browser_cgroup.run_parent), made by the first worker that
    # starts Chromium and removed by the run's end; "": each worker's own, removed when its browser stops.
    browser_cgroup: str = ""
    # Overrides of the variables below; the runner passes tool_env_snapshot() taken in the parent,
    # so workers see the same settings whatever their own environment.
    tool_env: Mapping[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The variables in force: the environment overlaid by ``tool_env``."""
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in self.tool_env.items()})
        return env


NO_SETTINGS = ToolSettings()  # outside a run: this process's environment, no run endpoint


def tool_env_snapshot(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tool variables set in ``env`` (default: this process's environment), for
    ``ToolSettings.tool_env``: worker processes then see the parent's settings whatever their own
    environment. The values of SECRET_ENV_VARS are API keys: keep them out of any output."""
    env = os.environ if env is None else env
    return {name: env[name] for name in TOOL_ENV_VARS if env.get(name)}


def run_tool_settings(
    *, base_url: str, api_key: str | None, model: str, run_dir: str, browser_cgroup: str = ""
) -> ToolSettings:
    """A run's tool settings: its endpoint (vision, moa), its directory (images), the tool variables."""
    return ToolSettings(
        llm_base_url=base_url,
        llm_api_key=api_key,
        llm_model=model,
        run_dir=run_dir,
        tool_env=tool_env_snapshot(),
        browser_cgroup=browser_cgroup,
    )


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value.strip() if value and value.strip() else None


def _number(
    env: Mapping[str, str], name: str, default: float, *, integer: bool = False, maximum: float | None = None
) -> Any:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ToolConfigError(f"{name} must be {kind}, got {raw!r}") from None
    if not math.isfinite(value):
        # float() reads "nan", "inf" and "1e999": a timeout of nan failed every fetch with a ValueError
        # from the socket layer, one of inf killed the deadline's timer thread.
        raise ToolConfigError(f"{name} must be a finite number, got {raw!r}")
    if value <= 0 and not name.endswith("TEMPERATURE"):
        raise ToolConfigError(f"{name} must be positive, got {raw!r}")
    if value < 0:
        raise ToolConfigError(f"{name} must not be negative, got {raw!r}")
    if maximum is not None and value > maximum:
        raise ToolConfigError(f"{name} must be at most {maximum:g}, got {raw!r}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(env, name)
    if raw is None:
        return default
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ToolConfigError(f"{name} must be 1 or 0, got {raw!r}")


def allow_private_addresses(env: Mapping[str, str]) -> bool:
    """``WEB_ALLOW_PRIVATE_ADDRESSES``: whether model-given URLs may reach private addresses."""
    return _flag(env, "WEB_ALLOW_PRIVATE_ADDRESSES", False)


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    return _number(env, name, 0, integer=True) if _get(env, name) is not None else None


def _url(env: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    raw = _get(env, name) or default
    if raw is None:
        return None
    if not raw.startswith(("http://", "https://")):
        raise ToolConfigError(f"{name} must be an http(s) URL, got {raw!r}")
    return raw.rstrip("/")


# ----------------------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible endpoint and the model to ask there."""

    base_url: str
    api_key: str | None
    model: str


def _endpoint(env: Mapping[str, str], run: ToolSettings, prefix: str) -> tuple[str, str | None] | None:
    """(base_url, api_key) for a toolset: its own variables, else the run's endpoint."""
    own_url = _url(env, f"{prefix}_BASE_URL")
    run_url = run.llm_base_url
    if own_url is None and not run_url:
        return None
    base_url = own_url or str(run_url).rstrip("/")
    key = _get(env, f"{prefix}_API_KEY")
    if key is None and base_url == str(run_url or "").rstrip("/"):
        key = run.llm_api_key or None
    return base_url, key


_CLIENTS: dict[tuple[str, str | None], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def model_client(ctx: Any, base_url: str, api_key: str | None) -> Any:
    """The model client a tool calls its model through: the run's (``ctx.llm``: its limiter, run-wide
    pause, retries, bounds and budget) for the tool's endpoint; outside a run, one of its own."""
    llm = getattr(ctx, "llm", None)
    if llm is not None:
        return llm.for_endpoint(base_url, api_key)
    from batchrun.prompt.llm import LLMClient, LLMConfig

    with _CLIENTS_LOCK:
        client = _CLIENTS.get((base_url, api_key))
        if client is None:
            client = _CLIENTS[(base_url, api_key)] = LLMClient(
                LLMConfig(model="", base_url=base_url, api_key=api_key, max_retries=2)
            )
    return client


# ----------------------------------------------------------------------------- web


@dataclass(frozen=True)
class SearchConfig:
    provider: str  # one of SEARCH_PROVIDERS
    base_url: str  # provider API base (SearXNG: the instance)
    api_key: str | None
    max_results: int  # results asked for and shown
    timeout_s: float  # one search request


@dataclass(frozen=True)
class ExtractConfig:
    timeout_s: float  # one page fetch, connect to last byte
    max_bytes: int  # larger bodies are refused
    max_chars: int  # text kept per page (the results budget may lower it)
    user_agent: str
    allow_private: bool = False  # WEB_ALLOW_PRIVATE_ADDRESSES: fetch from private addresses too


def search_config(run: ToolSettings = NO_SETTINGS) -> SearchConfig | None:
    """The search provider in force, or None when none is configured."""
    env = run.env()
    provider = _get(env, "WEB_SEARCH_PROVIDER")
    if provider is not None:
        provider = provider.lower()
        if provider not in SEARCH_PROVIDERS:
            raise ToolConfigError(
                f"WEB_SEARCH_PROVIDER must be one of {', '.join(SEARCH_PROVIDERS)}, got {provider!r}"
            )
    else:
        for name in ("tavily", "brave", "exa", "firecrawl"):
            if _get(env, _PROVIDER_KEY_VARS[name]):
                provider = name
                break
        else:
            if _get(env, "SEARXNG_URL"):
                provider = "searxng"
    if provider is None:
        return None
    url_var = _PROVIDER_URL_VARS[provider]
    base_url = _url(env, url_var, _PROVIDER_DEFAULT_URLS.get(provider))
    if base_url is None:
        raise ToolConfigError(f"WEB_SEARCH_PROVIDER=searxng needs {url_var}")
    key_var = _PROVIDER_KEY_VARS.get(provider)
    api_key = _get(env, key_var) if key_var else None
    self_hosted = provider == "firecrawl" and _get(env, url_var) is not None
    if key_var and api_key is None and not self_hosted:
        raise ToolConfigError(f"WEB_SEARCH_PROVIDER={provider} needs {key_var}")
    return SearchConfig(
        provider=provider,
        base_url=base_url,
        api_key=api_key,
        max_results=min(_number(env, "WEB_SEARCH_MAX_RESULTS", 5, integer=True), 20),
        timeout_s=_number(env, "WEB_TIMEOUT_S", 30.0),
    )


def extract_config(run: ToolSettings = NO_SETTINGS) -> ExtractConfig:
    env = run.env()
    return ExtractConfig(
        timeout_s=_number(env, "WEB_TIMEOUT_S", 30.0),
        max_bytes=_number(env, "WEB_EXTRACT_MAX_BYTES", 5_000_000, integer=True),
        max_chars=_number(env, "WEB_EXTRACT_MAX_CHARS", 20_000, integer=True),
        user_agent=_get(env, "WEB_USER_AGENT")
        or "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) batch-runner-web/1.0",
        allow_private=allow_private_addresses(env),
    )


# ----------------------------------------------------------------------------- vision


@dataclass(frozen=True)
class VisionConfig:
    endpoint: Endpoint
    max_image_bytes: int  # larger images are refused
    max_tokens: int | None  # per answer; None: the endpoint's default
    timeout_s: float  # one model call


def vision_config(run: ToolSettings = NO_SETTINGS) -> VisionConfig | None:
    env = run.env()
    model = _get(env, "VISION_MODEL") or run.llm_model
    where = _endpoint(env, run, "VISION")
    if where is None or not model:
        return None
    return VisionConfig(
        endpoint=Endpoint(where[0], where[1], str(model)),
        max_image_bytes=_number(env, "VISION_MAX_IMAGE_BYTES", 10_000_000, integer=True),
        max_tokens=_optional_int(env, "VISION_MAX_TOKENS"),
        timeout_s=_number(env, "VISION_TIMEOUT_S", 120.0),
    )


# ----------------------------------------------------------------------------- image_gen


@dataclass(frozen=True)
class ImageGenConfig:
    endpoint: Endpoint
    sizes: dict[str, str]  # aspect ratio -> "WxH" sent as `size`
    response_format: str | None  # None: let the endpoint choose (b64_json or url both handled)
    timeout_s: float  # one generation request
    max_bytes: int  # largest image accepted


def _sizes(env: Mapping[str, str]) -> dict[str, str]:
    raw = _get(env, "IMAGE_GEN_SIZES")
    sizes = dict(DEFAULT_IMAGE_SIZES)
    if raw is None:
        return sizes
    for item in raw.split(","):
        name, _, size = item.strip().partition("=")
        w, _, h = size.strip().partition("x")
        if name.strip() not in ASPECT_RATIOS or not (
            w.isdigit() and h.isdigit() and 0 < int(w) <= MAX_IMAGE_SIDE and 0 < int(h) <= MAX_IMAGE_SIDE
        ):
            raise ToolConfigError(
                f"IMAGE_GEN_SIZES must look like 'landscape=1536x1024,square=1024x1024', each side from 1 to "
                f"{MAX_IMAGE_SIDE}, got {raw!r}"
            )
        sizes[name.strip()] = size.strip()
    return sizes


def image_gen_config(run: ToolSettings = NO_SETTINGS) -> ImageGenConfig | None:
    env = run.env()
    model = _get(env, "IMAGE_GEN_MODEL")
    if model is None:
        return None
    where = _endpoint(env, run, "IMAGE_GEN")
    if where is None:
        return None
    fmt = _get(env, "IMAGE_GEN_RESPONSE_FORMAT")
    if fmt is not None and fmt not in ("b64_json", "url"):
        raise ToolConfigError(f"IMAGE_GEN_RESPONSE_FORMAT must be b64_json or url, got {fmt!r}")
    return ImageGenConfig(
        endpoint=Endpoint(where[0], where[1], model),
        sizes=_sizes(env),
        response_format=fmt,
        timeout_s=_number(env, "IMAGE_GEN_TIMEOUT_S", 180.0),
        max_bytes=_number(env, "IMAGE_GEN_MAX_BYTES", 20_000_000, integer=True),
    )


# ----------------------------------------------------------------------------- moa


@dataclass(frozen=True)
class MoaConfig:
    base_url: str
    api_key: str | None
    reference_models: tuple[str, ...]  # asked in parallel
    aggregator_model: str  # writes the final answer from theirs
    reference_temperature: float
    aggregator_temperature: float
    max_tokens: int | None  # per model answer; None: the endpoint's default
    min_successful: int  # reference answers needed before aggregating
    timeout_s: float  # one model call


def moa_config(run: ToolSettings = NO_SETTINGS) -> MoaConfig | None:
    env = run.env()
    run_model = run.llm_model
    raw_refs = _get(env, "MOA_REFERENCE_MODELS")
    refs = tuple(m.strip() for m in raw_refs.split(",") if m.strip()) if raw_refs else ()
    if raw_refs and not refs:
        raise ToolConfigError(f"MOA_REFERENCE_MODELS names no model: {raw_refs!r}")
    refs = refs or ((str(run_model),) if run_model else ())
    aggregator = _get(env, "MOA_AGGREGATOR_MODEL") or (str(run_model) if run_model else None)
    where = _endpoint(env, run, "MOA")
    if where is None or not refs or not aggregator:
        return None
    min_ok = _number(env, "MOA_MIN_SUCCESSFUL", 1, integer=True)
    if min_ok > len(refs):
        raise ToolConfigError(f"MOA_MIN_SUCCESSFUL ({min_ok}) exceeds the {len(refs)} reference model(s)")
    return MoaConfig(
        base_url=where[0],
        api_key=where[1],
        reference_models=refs,
        aggregator_model=aggregator,
        reference_temperature=_number(env, "MOA_REFERENCE_TEMPERATURE", 0.6, maximum=MAX_TEMPERATURE),
        aggregator_temperature=_number(env, "MOA_AGGREGATOR_TEMPERATURE", 0.4, maximum=MAX_TEMPERATURE),
        max_tokens=_optional_int(env, "MOA_MAX_TOKENS"),
        min_successful=min_ok,
        timeout_s=_number(env, "MOA_TIMEOUT_S", 300.0),
    )


# ----------------------------------------------------------------------------- browser

# Chromium's own sandbox is on where it can be (browser_sandbox.py): "--no-sandbox" is added only where not.
BROWSER_FLAGS = (
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    # WebRTC's UDP bypasses the per-context proxy that checks addresses (browser.py): no UDP then.
    # (The switch that maps to the webrtc.ip_handling_policy pref; "--force-webrtc-..." is no switch.)
    "--webrtc-ip-handling-policy=disable_non_proxied_udp",
)


# A root worker starts Chromium as this user and group (nobody:nogroup; browser_sandbox.py): Chromium
# refuses its sandbox as root, and without it a renderer ran as root on the host.
BROWSER_UID = 65534
BROWSER_GID = 65534


# Chromium has no memory limit of its own (its sandbox sets none on renderers here, RLIMIT_AS unlimited):
# a page allocating in a loop reached 4 GB in 10 s. Each process (browser, renderer, GPU, ...) is
# started under this RLIMIT_DATA, so a page past it gets allocation failures or a crashed tab.
BROWSER_MEMORY_MB = 2048
MIN_BROWSER_MEMORY_MB = 1024
# A worker's whole Chromium (browser_cgroup.py): that RLIMIT_DATA is per process, and a page spreading over
# renderers (cross-site frames, or 16 prompts' pages) multiplied it; and nothing bounded its CPU.
BROWSER_CPUS = 1.0
MIN_BROWSER_CPUS = 0.1  # a page's load takes ~0.5 s of CPU: below this, tens of seconds
BROWSER_TREE_MEMORY_MB = 4096
# Measured: a screenshot took 1.4 s at 8192x8192; at 20000x20000 it never came within 20 s.
MAX_VIEWPORT_SIDE = 8192
# Playwright's timers are Node's: past 2**31 - 1 ms (24.8 days) Node sets them to 1 ms, and with
# BROWSER_NAV_TIMEOUT_S=3000000 every navigation failed at once ("Timeout 3000000000ms exceeded").
MAX_BROWSER_TIMEOUT_S = 86400


@dataclass(frozen=True)
class BrowserConfig:
    executable: str  # the Chromium binary Playwright launches
    nav_timeout_s: float  # one navigation
    action_timeout_s: float  # one click, fill or key press
    snapshot_max_chars: int  # default snapshot size; full=true allows four times as much
    viewport: tuple[int, int]  # width, height in CSS pixels
    allow_private: bool = False  # WEB_ALLOW_PRIVATE_ADDRESSES: let pages reach private addresses
    memory_mb: int = 2048  # RLIMIT_DATA of every Chromium process (a page's renderer above all)
    cpus: float = BROWSER_CPUS  # CPU quota of the worker's Chromium, all its processes (cgroup)
    tree_memory_mb: int = (
        BROWSER_TREE_MEMORY_MB  # memory of the worker's Chromium, all its processes (cgroup)
    )
    cgroup_parent: str = ""  # ToolSettings.browser_cgroup: the parent of the run's browsers' cgroups


def find_chromium(env: Mapping[str, str]) -> str | None:
    explicit = _get(env, "BROWSER_EXECUTABLE")
    if explicit is not None:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise ToolConfigError(f"BROWSER_EXECUTABLE {explicit!r} is not an executable file")
        return explicit
    for candidate in BROWSER_CANDIDATES:
        found = candidate if os.path.isabs(candidate) else shutil.which(candidate)
        if found and os.path.isfile(found) and os.access(found, os.X_OK):
            return found
    return None


# Toolsets whose code needs an optional extra of the package (the light core has neither):
# toolset -> (the extra's name, the modules it brings). A distribution that may draw one of these
# while its modules are missing is refused at start with the pip line (``missing_extras``).
TOOLSET_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "browser": ("browser", ("playwright",)),
}


def extra_missing(toolset: str) -> str | None:
    """The extra ``toolset`` needs and this installation lacks, or None."""
    extra, modules = TOOLSET_EXTRAS.get(toolset, ("", ()))
    return extra if any(importlib.util.find_spec(m) is None for m in modules) else None


def pip_line(extras: Iterable[str]) -> str:
    """The command that installs ``extras``: pip install 'batch-runner[a,b]'."""
    return f"pip install 'batch-runner[{','.join(sorted(set(extras)))}]'"


def browser_config(run: ToolSettings = NO_SETTINGS) -> BrowserConfig | None:
    env = run.env()
    enabled = (_get(env, "BROWSER_ENABLED") or "1").lower()
    if enabled not in ("1", "0", "true", "false", "yes", "no"):
        raise ToolConfigError(f"BROWSER_ENABLED must be 1 or 0, got {enabled!r}")
    if enabled in ("0", "false", "no") or extra_missing("browser"):
        return None
    executable = find_chromium(env)
    if executable is None:
        return None
    raw_vp = _get(env, "BROWSER_VIEWPORT") or "1280x800"
    w, _, h = raw_vp.partition("x")
    if not (
        w.isdigit() and h.isdigit() and 0 < int(w) <= MAX_VIEWPORT_SIDE and 0 < int(h) <= MAX_VIEWPORT_SIDE
    ):
        raise ToolConfigError(
            f"BROWSER_VIEWPORT must look like 1280x800, each side at most {MAX_VIEWPORT_SIDE}, got {raw_vp!r}"
        )
    memory_mb = _number(env, "BROWSER_MEMORY_MB", BROWSER_MEMORY_MB, integer=True)
    if memory_mb < MIN_BROWSER_MEMORY_MB:
        # A renderer maps about 650 MB of it for an empty page; below this Chromium cannot start pages.
        raise ToolConfigError(f"BROWSER_MEMORY_MB must be at least {MIN_BROWSER_MEMORY_MB}, got {memory_mb}")
    tree_memory_mb = _number(env, "BROWSER_TREE_MEMORY_MB", BROWSER_TREE_MEMORY_MB, integer=True)
    if tree_memory_mb < MIN_BROWSER_MEMORY_MB:
        raise ToolConfigError(
            f"BROWSER_TREE_MEMORY_MB must be at least {MIN_BROWSER_MEMORY_MB}, got {tree_memory_mb}"
        )
    cpus = _number(env, "BROWSER_CPUS", BROWSER_CPUS)
    if cpus < MIN_BROWSER_CPUS:
        raise ToolConfigError(
            f"BROWSER_CPUS must be a number of cores from {MIN_BROWSER_CPUS:g}, got {cpus:g}"
        )
    return BrowserConfig(
        executable=executable,
        nav_timeout_s=_number(env, "BROWSER_NAV_TIMEOUT_S", 30.0, maximum=MAX_BROWSER_TIMEOUT_S),
        action_timeout_s=_number(env, "BROWSER_ACTION_TIMEOUT_S", 10.0, maximum=MAX_BROWSER_TIMEOUT_S),
        snapshot_max_chars=_number(env, "BROWSER_SNAPSHOT_MAX_CHARS", 8000, integer=True),
        viewport=(int(w), int(h)),
        allow_private=allow_private_addresses(env),
        memory_mb=memory_mb,
        cpus=cpus,
        tree_memory_mb=tree_memory_mb,
        cgroup_parent=run.browser_cgroup,
    )
