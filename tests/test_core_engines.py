"""Table tests of engine kinds, signal parsers and the decisions made from them.

The parsers run over answers recorded from the real llama-server and over
the other engines' shapes from their source and docs (tests/data/engines/),
and over malformed and partial answers, which give a ``last_error`` and
never raise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_failover.core.engine_parsers import (
    MetricSample,
    llama_props,
    llama_slots,
    lmstudio_models,
    looks_like,
    next_detection,
    ollama_ps,
    vllm_signals,
)
from trio_failover.core.engines import (
    ASKED_BY_THE_CHECK,
    AUTO_FROM_SLOTS,
    AUTO_NONE,
    AUTO_ONE_AT_A_TIME,
    DETECTION_PATHS,
    ENGINE_KINDS,
    MAX_SIGNAL_BYTES,
    SIGNAL_PATHS,
    UNKNOWN,
    Answer,
    Ask,
    Capacity,
    Detection,
    EngineKind,
    LoadedModel,
    ModelLoad,
    Scope,
    Signals,
    capacity_at_start,
    configured_engine,
    cooldown_scope,
    current_signals,
    failed,
    head_timeout,
    is_fresh,
    merge_signals,
    model_loaded,
    needs_cold_start,
    resolve_capacity,
    serves_many,
    stale_after,
)
from trio_failover.wire.engine_metrics import prometheus_samples, read_signals, vllm_metrics

DATA = Path(__file__).resolve().parent / "data" / "engines"
JSON = "application/json; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4"


def recorded(name: str, content_type: str = JSON, status: int = 200) -> Answer:
    """A fixture file under tests/data/engines/ as an answer."""
    return Answer(status, content_type, (DATA / name).read_bytes())


def ok(document: object) -> Answer:
    return Answer(200, JSON, json.dumps(document).encode())


# -- engine kinds -----------------------------------------------------------------------


def test_engine_kinds_are_spec_3s_values_word_for_word() -> None:
    assert ENGINE_KINDS == (
        "auto",
        "openai",
        "ollama",
        "llama-server",
        "llama-cpp-python",
        "vllm",
        "lmstudio",
    )
    assert set(SIGNAL_PATHS) == set(EngineKind) - {EngineKind.AUTO}


@pytest.mark.parametrize(
    ("kind", "detection"),
    [
        (EngineKind.AUTO, None),
        (EngineKind.OPENAI, Detection(EngineKind.OPENAI, "configured")),
        (EngineKind.VLLM, Detection(EngineKind.VLLM, "configured")),
    ],
)
def test_a_configured_kind_is_not_detected(kind: EngineKind, detection: Detection | None) -> None:
    assert configured_engine(kind) == detection


# -- detection --------------------------------------------------------------------------

NOT_FOUND = Answer(404, JSON, b'{"error": {"code": 404, "message": "File Not Found"}}')
LLAMA_CPP_PYTHON = "llama-cpp-python/"
ASKED = [path for _, path in DETECTION_PATHS if path not in ASKED_BY_THE_CHECK]


def not_found_up_to(path: str) -> dict[str, Answer | None]:
    """404 for every question detection asks before ``path``."""
    return {asked: NOT_FOUND for asked in ASKED[: ASKED.index(path)]}


LCP_MODELS = Detection(
    EngineKind.LLAMA_CPP_PYTHON, 'GET /v1/models: owned_by "me" with permissions'
)
LCP_OPENAPI = Detection(
    EngineKind.LLAMA_CPP_PYTHON, 'GET /openapi.json: title "llama.cpp Python API"'
)
LLAMA = Detection(EngineKind.LLAMA_SERVER, "GET /props: total_slots")
NO_ENGINE = Detection(EngineKind.OPENAI, "no engine answer")

# answers so far -> the next step: a Detection, the next question, or None.
DETECTION_STEPS = [
    pytest.param({}, Ask("/props"), id="first-props-the-checks-own-question-skipped"),
    pytest.param(
        {"/v1/models": recorded(LLAMA_CPP_PYTHON + "v1-models.json")},
        LCP_MODELS,
        id="llama-cpp-python-from-the-checks-answer-asks-nothing",
    ),
    pytest.param(
        {"/v1/models": recorded("llama-server/v1-models.json")},
        Ask("/props"),
        id="llama-servers-model-list-decides-nothing",
    ),
    pytest.param(
        {"/props": recorded("llama-server/props.json")},
        LLAMA,
        id="llama-server-props-decide-at-once",
    ),
    pytest.param({"/props": NOT_FOUND}, Ask("/api/version"), id="a-404-moves-on"),
    pytest.param({"/props": None}, Ask("/api/version"), id="a-failed-read-moves-on"),
    pytest.param(
        {"/props": NOT_FOUND, "/api/version": recorded("ollama/version.json")},
        Detection(EngineKind.OLLAMA, "GET /api/version: version"),
        id="ollama",
    ),
    pytest.param(
        {**not_found_up_to("/metrics"), "/metrics": recorded("vllm/metrics.txt", PROMETHEUS)},
        Detection(EngineKind.VLLM, "GET /metrics: vllm: series"),
        id="vllm",
    ),
    pytest.param(
        {**not_found_up_to("/metrics"), "/metrics": recorded("vllm/metrics-v0.txt", PROMETHEUS)},
        Detection(EngineKind.VLLM, "GET /metrics: vllm: series"),
        id="vllm-v0",
    ),
    pytest.param(
        # llama-server with --metrics exports llamacpp: series: not vLLM's.
        {
            **not_found_up_to("/metrics"),
            "/metrics": recorded("llama-server/metrics-deferred.txt", PROMETHEUS),
        },
        Ask("/api/v0/models"),
        id="llamacpp-metrics-are-not-vllm",
    ),
    pytest.param(
        {
            **not_found_up_to("/api/v0/models"),
            "/api/v0/models": recorded("lmstudio/models.json"),
        },
        Detection(EngineKind.LMSTUDIO, "GET /api/v0/models: state per model"),
        id="lmstudio",
    ),
    pytest.param(
        not_found_up_to("/openapi.json"),
        Ask("/openapi.json"),
        id="openapi-last",
    ),
    pytest.param(
        {
            **not_found_up_to("/openapi.json"),
            "/openapi.json": recorded(LLAMA_CPP_PYTHON + "openapi.json"),
        },
        LCP_OPENAPI,
        id="llama-cpp-python-from-its-openapi-title",
    ),
    pytest.param(
        {
            # llama-cpp-python as recorded: 404 to each engine's own read.
            **{path: recorded(LLAMA_CPP_PYTHON + "props.json", status=404) for path in ASKED[:-1]},
            "/openapi.json": recorded(LLAMA_CPP_PYTHON + "openapi.json"),
        },
        LCP_OPENAPI,
        id="llama-cpp-python-as-recorded-when-the-check-had-no-list",
    ),
    pytest.param(
        {path: NOT_FOUND for path in ASKED},
        NO_ENGINE,
        id="all-404",
    ),
    pytest.param(
        {**dict.fromkeys(ASKED), "/v1/models": recorded("llama-server/v1-models.json")},
        None,
        id="no-own-answer-decides-nothing-the-checks-does-not-count",
    ),
    pytest.param({**dict.fromkeys(ASKED), "/props": NOT_FOUND}, NO_ENGINE, id="one-own-answer"),
    pytest.param(
        {
            **{path: NOT_FOUND for path in ASKED},
            "/props": ok({"total_slots": True}),
            "/api/version": ok({"version": 3}),
        },
        NO_ENGINE,
        id="wrong-types",
    ),
    pytest.param(
        {
            **{path: NOT_FOUND for path in ASKED},
            "/api/v0/models": ok({"data": []}),
            "/metrics": Answer(200, PROMETHEUS, b"x 1\n"),
        },
        NO_ENGINE,
        id="empty-lmstudio-list-and-foreign-metrics",
    ),
    pytest.param(
        {"/props": Answer(503, JSON, b'{"total_slots": 2}'), "/api/version": ok({"version": "1"})},
        Detection(EngineKind.OLLAMA, "GET /api/version: version"),
        id="a-non-200-answer-is-no-evidence",
    ),
    pytest.param(
        {"/props": ok({"total_slots": 2}), "/api/version": ok({"version": "1"})},
        LLAMA,
        id="order-llama-server-first",
    ),
    pytest.param(
        {
            "/v1/models": recorded(LLAMA_CPP_PYTHON + "v1-models.json"),
            "/props": ok({"total_slots": 2}),
        },
        LCP_MODELS,
        id="order-the-checks-answer-first",
    ),
    pytest.param(
        {"/v1/models": Answer(503, JSON, recorded(LLAMA_CPP_PYTHON + "v1-models.json").body)},
        Ask("/props"),
        id="llama-cpp-python-list-not-200",
    ),
    pytest.param(
        {"/v1/models": ok({"data": [{"id": "m", "owned_by": "me"}]})},
        Ask("/props"),
        id="owned-by-me-without-permissions",
    ),
    pytest.param(
        {"/v1/models": ok({"data": [{"id": "m", "owned_by": "me", "permissions": []}, {}]})},
        Ask("/props"),
        id="every-model-owned-by-me",
    ),
    pytest.param({"/v1/models": ok({"data": []})}, Ask("/props"), id="empty-list"),
    pytest.param(
        {
            **{path: NOT_FOUND for path in ASKED},
            "/openapi.json": ok({"openapi": "3.1.0", "info": {"title": "FastAPI"}}),
        },
        NO_ENGINE,
        id="another-fastapi-app",
    ),
    pytest.param(
        {**{path: NOT_FOUND for path in ASKED}, "/openapi.json": ok({"info": "x"})},
        NO_ENGINE,
        id="openapi-info-not-an-object",
    ),
]


@pytest.mark.parametrize(("answers", "step"), DETECTION_STEPS)
def test_next_detection(answers: dict[str, Answer | None], step: Detection | Ask | None) -> None:
    assert next_detection(answers) == step


def test_detection_asks_each_question_once_in_order_then_gives_up() -> None:
    answers: dict[str, Answer | None] = {}
    asked = []
    for _ in range(len(DETECTION_PATHS) + 1):
        step = next_detection(answers)
        if not isinstance(step, Ask):
            break
        asked.append(step.path)
        answers[step.path] = None  # no answer at all: the node went away
    assert step is None
    assert asked == ["/props", "/api/version", "/metrics", "/api/v0/models", "/openapi.json"]


def test_looks_like_refuses_an_oversized_answer() -> None:
    body = b'{"total_slots": 1, "pad": "' + b"x" * MAX_SIGNAL_BYTES + b'"}'
    assert looks_like(EngineKind.LLAMA_SERVER, Answer(200, JSON, body)) == ""
    assert looks_like(EngineKind.OPENAI, ok({"total_slots": 1})) == ""


# -- llama-server -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "busy"), [("slots-idle.json", 0), ("slots-busy.json", 1), ("slots-full.json", 2)]
)
def test_recorded_llama_server_slots(name: str, busy: int) -> None:
    assert llama_slots(recorded(f"llama-server/{name}")) == Signals(busy=busy)


@pytest.mark.parametrize("name", ["props.json", "props-busy.json"])
def test_recorded_llama_server_props(name: str) -> None:
    assert llama_props(recorded(f"llama-server/{name}")) == Signals(total_slots=2)


def test_recorded_llama_server_answers_are_as_the_index_says() -> None:
    index = json.loads((DATA / "llama-server" / "answers.json").read_text())
    for name, answer in index["answers"].items():
        if (DATA / "llama-server" / name).exists():
            assert answer["status"] == (503 if name == "health-loading.json" else 200), name
    assert "--parallel" in index["command"]


def test_llama_servers_loading_health_is_no_engine_answer() -> None:
    loading = recorded("llama-server/health-loading.json", status=503)
    assert next_detection({"/props": loading}) == Ask("/api/version")


LLAMA_BAD = [
    pytest.param(llama_slots, Answer(501, JSON, b"{}"), "GET /slots: HTTP 501", id="slots-501"),
    pytest.param(llama_slots, Answer(200, JSON, b"[{"), "GET /slots: not JSON", id="truncated"),
    pytest.param(
        llama_slots, ok({"slots": []}), "GET /slots: not a JSON list of slots", id="object"
    ),
    pytest.param(
        llama_slots,
        ok([{"id": 0, "is_processing": False}, {"id": 1}]),
        "GET /slots: slot 1 has no boolean is_processing",
        id="partial-slot",
    ),
    pytest.param(
        llama_slots,
        ok([{"id": 0, "is_processing": 1}]),
        "GET /slots: slot 0 has no boolean is_processing",
        id="number-not-bool",
    ),
    pytest.param(
        llama_slots, ok([3]), "GET /slots: slot 0 has no boolean is_processing", id="not-a-slot"
    ),
    pytest.param(llama_props, ok({}), "GET /props: no total_slots (a whole number >= 0)", id="p"),
    pytest.param(
        llama_props, ok({"total_slots": -1}), "GET /props: no total_slots (a whole number >= 0)"
    ),
    pytest.param(
        llama_props, ok({"total_slots": 2.5}), "GET /props: no total_slots (a whole number >= 0)"
    ),
    pytest.param(llama_props, ok([2]), "GET /props: no total_slots (a whole number >= 0)"),
    pytest.param(llama_props, Answer(200, JSON, b"\xff"), "GET /props: not JSON", id="utf-8"),
    pytest.param(
        llama_props,
        Answer(200, JSON, b"[" * 100_000),
        "GET /props: not JSON",
        id="deep-nesting",
    ),
    pytest.param(
        llama_props,
        Answer(200, JSON, b" " * (MAX_SIGNAL_BYTES + 1)),
        f"GET /props: more than {MAX_SIGNAL_BYTES} bytes",
        id="oversized",
    ),
]


@pytest.mark.parametrize(("parse", "answer", "error"), LLAMA_BAD)
def test_bad_llama_server_answers_give_last_error(
    parse: Callable[[Answer], Signals], answer: Answer, error: str
) -> None:
    assert parse(answer) == failed(error)


def test_an_empty_slot_list_is_no_slot_busy() -> None:
    assert llama_slots(ok([])) == Signals(busy=0)


# -- Ollama -----------------------------------------------------------------------------


def test_documented_ollama_ps() -> None:
    signals = ollama_ps(recorded("ollama/ps.json"))
    assert signals == Signals(
        loaded=frozenset({"mistral:latest"}),
        loaded_is_complete=True,
        loaded_details=(
            LoadedModel("mistral:latest", "2025-06-04T14:38:31.83753-07:00", 5137025024),
        ),
    )
    assert model_loaded(signals, "mistral") is True
    assert model_loaded(signals, "llama3.2") is False  # every loaded model is listed


OLLAMA = [
    pytest.param(
        recorded("ollama/ps-empty.json"),
        Signals(loaded=frozenset(), loaded_is_complete=True),
        id="none-loaded",
    ),
    pytest.param(
        ok({"models": None}), Signals(loaded=frozenset(), loaded_is_complete=True), id="null"
    ),
    pytest.param(
        ok({"models": [{"model": "m:7b"}]}),
        Signals(
            loaded=frozenset({"m:7b"}),
            loaded_is_complete=True,
            loaded_details=(LoadedModel("m:7b"),),
        ),
        id="model-field-only",
    ),
    pytest.param(ok({}), failed('GET /api/ps: no "models" list'), id="no-models"),
    pytest.param(ok({"models": {}}), failed('GET /api/ps: "models" is not a list'), id="object"),
    pytest.param(
        ok({"models": [{"name": "a"}, {"size_vram": 1}]}),
        failed("GET /api/ps: model 1 has no name"),
        id="partial-entry",
    ),
    pytest.param(Answer(500, JSON, b"{}"), failed("GET /api/ps: HTTP 500"), id="500"),
    pytest.param(Answer(200, "text/html", b"<html>"), failed("GET /api/ps: not JSON"), id="html"),
]


@pytest.mark.parametrize(("answer", "signals"), OLLAMA)
def test_ollama_ps(answer: Answer, signals: Signals) -> None:
    assert ollama_ps(answer) == signals


# -- LM Studio --------------------------------------------------------------------------


def test_documented_lmstudio_models() -> None:
    signals = lmstudio_models(recorded("lmstudio/models.json"))
    assert signals == Signals(
        loaded=frozenset({"meta-llama-3.1-8b-instruct"}),
        not_loaded=frozenset({"qwen2-vl-7b-instruct", "text-embedding-nomic-embed-text-v1.5"}),
    )
    assert model_loaded(signals, "meta-llama-3.1-8b-instruct") is True
    assert model_loaded(signals, "qwen2-vl-7b-instruct") is False
    assert model_loaded(signals, "never-downloaded") is None  # LM Studio lists what it has


LMSTUDIO = [
    pytest.param(
        ok({"data": [{"id": "a", "state": "loading"}]}),
        Signals(loaded=frozenset(), not_loaded=frozenset()),
        id="unknown-state-is-unknown",
    ),
    pytest.param(
        ok({"object": "list"}), failed('GET /api/v0/models: no "data" list'), id="no-data"
    ),
    pytest.param(
        ok({"data": [{"id": "a"}]}),
        failed("GET /api/v0/models: model 0 has no id and state"),
        id="no-state",
    ),
    pytest.param(
        ok({"data": ["a"]}), failed("GET /api/v0/models: model 0 has no id and state"), id="str"
    ),
    pytest.param(Answer(401, JSON, b"{}"), failed("GET /api/v0/models: HTTP 401"), id="401"),
]


@pytest.mark.parametrize(("answer", "signals"), LMSTUDIO)
def test_lmstudio_models(answer: Answer, signals: Signals) -> None:
    assert lmstudio_models(answer) == signals


# -- vLLM -------------------------------------------------------------------------------

QWEN = "Qwen/Qwen3-0.6B"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def test_documented_vllm_metrics() -> None:
    assert vllm_metrics(recorded("vllm/metrics.txt", PROMETHEUS)) == Signals(
        busy=3, waiting=2, kv_cache_usage=0.4213, per_model={QWEN: ModelLoad(3, 2, 0.4213)}
    )


def test_vllm_data_parallel_engines_add_up_and_the_new_kv_name_wins() -> None:
    assert vllm_metrics(recorded("vllm/metrics-data-parallel.txt", PROMETHEUS)) == Signals(
        busy=9, waiting=1, kv_cache_usage=0.75, per_model={LLAMA: ModelLoad(9, 1, 0.75)}
    )


def test_vllm_v0_metrics_with_the_old_kv_name() -> None:
    model = "/models/llama-2-7b"
    assert vllm_metrics(recorded("vllm/metrics-v0.txt", PROMETHEUS)) == Signals(
        busy=1, waiting=0, kv_cache_usage=0.0625, per_model={model: ModelLoad(1, 0, 0.0625)}
    )


def sample(name: str, value: float, model: str | None = "m") -> MetricSample:
    return MetricSample(name, {} if model is None else {"model_name": model}, value)


VLLM = [
    pytest.param(
        [
            sample("vllm:num_requests_running", 1, "a"),
            sample("vllm:num_requests_running", 2, "b"),
            sample("vllm:num_requests_waiting", 4, "b"),
        ],
        Signals(busy=3, waiting=4, per_model={"a": ModelLoad(1, 0), "b": ModelLoad(2, 4)}),
        id="two-models",
    ),
    pytest.param(
        [sample("vllm:num_requests_running", 2, None)],
        Signals(busy=2, waiting=0, per_model={}),
        id="no-model-label",
    ),
    pytest.param(
        [sample("vllm:num_requests_waiting", 1)],
        failed("GET /metrics: no vllm:num_requests_running series"),
        id="partial-no-running",
    ),
    pytest.param([], failed("GET /metrics: no vllm:num_requests_running series"), id="empty"),
    pytest.param(
        [sample("vllm:num_requests_running", float("nan"))],
        failed("GET /metrics: vllm:num_requests_running is nan"),
        id="nan",
    ),
    pytest.param(
        [sample("vllm:num_requests_running", 1), sample("vllm:kv_cache_usage_perc", -0.5)],
        failed("GET /metrics: vllm:kv_cache_usage_perc is -0.5"),
        id="negative",
    ),
    pytest.param(
        [
            sample("vllm:num_requests_running", 1),
            sample("vllm:kv_cache_usage_perc", 0.75),
            sample("vllm:kv_cache_usage_perc", 0.25),  # a second engine of the model
        ],
        Signals(busy=1, waiting=0, kv_cache_usage=0.75, per_model={"m": ModelLoad(1, 0, 0.75)}),
        id="kv-highest-engine",
    ),
    pytest.param(
        [
            sample("vllm:gpu_cache_usage_perc", 0.5),
            sample("vllm:num_requests_running", 1),
            sample("vllm:kv_cache_usage_perc", 0.25),
        ],
        Signals(busy=1, waiting=0, kv_cache_usage=0.25, per_model={"m": ModelLoad(1, 0, 0.25)}),
        id="new-kv-name-wins",
    ),
    pytest.param(
        [sample("vllm:num_requests_running", 1), sample("vllm:prompt_tokens_total", 9)],
        Signals(busy=1, waiting=0, per_model={"m": ModelLoad(1, 0)}),
        id="other-series-ignored",
    ),
]


@pytest.mark.parametrize(("samples", "signals"), VLLM)
def test_vllm_signals(samples: list[MetricSample], signals: Signals) -> None:
    assert vllm_signals(samples) == signals


VLLM_BAD_ANSWERS = [
    pytest.param(Answer(404, PROMETHEUS, b""), "GET /metrics: HTTP 404", id="404"),
    pytest.param(Answer(200, PROMETHEUS, b"\xff\xfe"), "GET /metrics: not UTF-8 text", id="utf8"),
    pytest.param(
        Answer(200, PROMETHEUS, b'vllm:num_requests_running{model_name="m"} lots\n'),
        "GET /metrics: not Prometheus text (could not convert string to float: 'lots')",
        id="bad-value",
    ),
    pytest.param(
        Answer(200, PROMETHEUS, b"<html><body>Bad gateway</body></html>\n"),
        "GET /metrics: not Prometheus text",
        id="html",
    ),
    pytest.param(
        Answer(200, PROMETHEUS, b"# TYPE vllm:num_requests_running gauge\n"),
        "GET /metrics: no vllm:num_requests_running series",
        id="type-line-only",
    ),
    pytest.param(
        Answer(200, PROMETHEUS, b"x" * (MAX_SIGNAL_BYTES + 1)),
        f"GET /metrics: more than {MAX_SIGNAL_BYTES} bytes",
        id="oversized",
    ),
]


@pytest.mark.parametrize(("answer", "error"), VLLM_BAD_ANSWERS)
def test_bad_vllm_answers_give_last_error(answer: Answer, error: str) -> None:
    signals = vllm_metrics(answer)
    assert signals.last_error.startswith(error)
    assert attrs_without_error(signals) == attrs_without_error(UNKNOWN)


def attrs_without_error(signals: Signals) -> tuple[object, ...]:
    return (signals.busy, signals.waiting, signals.total_slots, signals.loaded, signals.per_model)


@given(st.binary(max_size=300))
def test_the_metrics_reader_never_raises(body: bytes) -> None:
    signals = vllm_metrics(Answer(200, PROMETHEUS, body))
    assert signals.last_error or signals.busy is not None


@given(st.text(max_size=200))
def test_prometheus_samples_never_raise(text: str) -> None:
    samples, error = prometheus_samples(text)
    assert not (samples and error)


@given(st.binary(max_size=200))
def test_the_json_parsers_never_raise(body: bytes) -> None:
    for parse in (llama_slots, llama_props, ollama_ps, lmstudio_models):
        signals = parse(Answer(200, JSON, body))
        assert isinstance(signals, Signals)


# -- a whole reading --------------------------------------------------------------------


def test_read_signals_merges_llama_servers_two_reads() -> None:
    answers: dict[str, Answer | str] = {
        "/slots": recorded("llama-server/slots-busy.json"),
        "/props": recorded("llama-server/props.json"),
    }
    assert read_signals(EngineKind.LLAMA_SERVER, answers) == Signals(busy=1, total_slots=2)


def test_read_signals_keeps_the_good_read_and_names_the_failed_one() -> None:
    answers: dict[str, Answer | str] = {"/slots": "timeout", "/props": ok({"total_slots": 4})}
    assert read_signals(EngineKind.LLAMA_SERVER, answers) == Signals(
        total_slots=4, last_error="GET /slots: timeout"
    )


def test_read_signals_of_each_kind() -> None:
    assert read_signals(EngineKind.OPENAI, {"/slots": ok([])}) == UNKNOWN
    assert read_signals(EngineKind.VLLM, {}) == UNKNOWN
    assert read_signals(EngineKind.OLLAMA, {"/api/ps": ok({"models": []})}).loaded == frozenset()
    lm = read_signals(EngineKind.LMSTUDIO, {"/api/v0/models": recorded("lmstudio/models.json")})
    assert lm.loaded == frozenset({"meta-llama-3.1-8b-instruct"})
    vllm = read_signals(EngineKind.VLLM, {"/metrics": recorded("vllm/metrics.txt", PROMETHEUS)})
    assert (vllm.busy, vllm.waiting) == (3, 2)


def test_merge_joins_errors_and_later_fields_win() -> None:
    merged = merge_signals([Signals(busy=1, last_error="a"), Signals(busy=2), failed("b")])
    assert merged == Signals(busy=2, last_error="a; b")
    assert merge_signals([]) == UNKNOWN


# -- staleness --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load_interval", "check_interval", "max_age"),
    [(2.0, 30.0, 6.0), (0.5, 30.0, 1.5), (0.0, 30.0, 90.0)],
)
def test_stale_after_three_intervals(
    load_interval: float, check_interval: float, max_age: float
) -> None:
    assert stale_after(load_interval, check_interval) == max_age


@pytest.mark.parametrize(
    ("read_at", "now", "fresh"),
    [(None, 0.0, False), (10.0, 10.0, True), (10.0, 16.0, True), (10.0, 16.001, False)],
)
def test_is_fresh(read_at: float | None, now: float, fresh: bool) -> None:
    assert is_fresh(read_at, now, 6.0) is fresh
    busy = Signals(busy=2)
    assert current_signals(busy, read_at, now, 6.0) == (busy if fresh else UNKNOWN)


def test_no_reading_is_unknown() -> None:
    assert current_signals(None, 1.0, 1.0, 6.0) == UNKNOWN


# -- capacity and load ------------------------------------------------------------------


LCP = EngineKind.LLAMA_CPP_PYTHON


@pytest.mark.parametrize(
    ("configured", "kind", "total_slots", "capacity"),
    [
        (None, None, 4, Capacity(4, AUTO_FROM_SLOTS)),
        (None, EngineKind.LLAMA_SERVER, 4, Capacity(4, AUTO_FROM_SLOTS)),
        (None, None, None, Capacity(0, AUTO_NONE)),
        (None, None, 0, Capacity(0, AUTO_NONE)),
        (None, EngineKind.VLLM, None, Capacity(0, AUTO_NONE)),
        (None, LCP, None, Capacity(1, AUTO_ONE_AT_A_TIME)),  # one request at a time
        (None, LCP, 4, Capacity(1, AUTO_ONE_AT_A_TIME)),  # its nature, whatever a read says
        (2, None, 4, Capacity(2, "--capacity a=2")),
        (2, LCP, None, Capacity(2, "--capacity a=2")),  # a configured number wins
        (0, LCP, 4, Capacity(0, "--capacity a=2")),  # a configured 0 (no limit) wins too
    ],
)
def test_resolve_capacity(
    configured: int | None,
    kind: EngineKind | None,
    total_slots: int | None,
    capacity: Capacity,
) -> None:
    assert resolve_capacity(configured, "--capacity a=2", total_slots, kind=kind) == capacity


@pytest.mark.parametrize(
    ("configured", "engine", "capacity"),
    [
        (None, "auto", 0),  # known when its engine says
        (None, "llama-server", 0),  # likewise: its /props
        (None, "llama-cpp-python", 1),  # known from its kind alone, before any read
        (3, "llama-cpp-python", 3),
        (None, "openai", 0),
    ],
)
def test_capacity_at_start(configured: int | None, engine: str, capacity: int) -> None:
    assert capacity_at_start(configured, engine) == capacity


# -- loaded models ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signals", "model", "loaded"),
    [
        (UNKNOWN, "m", None),
        (Signals(loaded=frozenset({"m:latest"}), loaded_is_complete=True), "m", True),
        (Signals(loaded=frozenset(), loaded_is_complete=True), "m", False),
        (Signals(loaded=frozenset(), not_loaded=frozenset({"m"})), "m", False),
        (Signals(loaded=frozenset(), not_loaded=frozenset({"x"})), "m", None),
    ],
)
def test_model_loaded(signals: Signals, model: str, loaded: bool | None) -> None:
    assert model_loaded(signals, model) is loaded


@pytest.mark.parametrize(
    ("loaded", "cold", "timeout"),
    [(True, False, 30.0), (None, False, 30.0), (False, True, 300.0)],
)
def test_cold_start_timeout_only_when_known_not_loaded(
    loaded: bool | None, cold: bool, timeout: float
) -> None:
    assert needs_cold_start(loaded) is cold
    assert head_timeout(loaded, response_header_timeout=30.0, cold_start_timeout=300.0) == timeout


def test_the_cold_start_timeout_replaces_the_header_timeout_even_when_shorter() -> None:
    assert head_timeout(False, response_header_timeout=30.0, cold_start_timeout=5.0) == 5.0


def test_a_cold_start_timeout_of_0_is_off() -> None:
    assert head_timeout(False, response_header_timeout=30.0, cold_start_timeout=0.0) == 30.0


# -- per-model cooldowns ----------------------------------------------------------------

SCOPES = [
    ("header_timeout", None, Scope.MODEL),
    ("first_body_timeout", 200, Scope.MODEL),
    ("retryable_response", 429, Scope.MODEL),
    ("retryable_response", 503, Scope.NODE),
    ("unresponsive", None, Scope.NODE),
    ("health_check", None, Scope.NODE),
    ("dead_peer", None, Scope.NODE),
    ("stream_idle_timeout", 200, Scope.NODE),
    # A 429 committed (not a retry status) that then stalls: the stall decides.
    ("stream_idle_timeout", 429, Scope.NODE),
    ("dead_peer", 429, Scope.NODE),
]


@pytest.mark.parametrize(("outcome", "status", "scope"), SCOPES)
def test_cooldown_scope_on_a_node_of_several_models(
    outcome: str, status: int | None, scope: Scope
) -> None:
    assert cooldown_scope(outcome, status, serves_many=True) is scope


@pytest.mark.parametrize(("outcome", "status", "scope"), SCOPES)
def test_a_single_model_node_cools_whole(outcome: str, status: int | None, scope: Scope) -> None:
    assert cooldown_scope(outcome, status, serves_many=False) is Scope.NODE


@pytest.mark.parametrize(
    ("configured", "inventory", "many"),
    [
        (None, None, False),
        (None, ["a"], False),
        (None, ["a", "b"], True),
        (["a"], ["a", "b"], False),  # the configured names win
        (["a", "b"], None, True),
        ({"client": "node"}, None, False),
        ({"a": "x", "b": "y"}, None, True),
        ({"*": "x"}, None, True),  # any model
    ],
)
def test_serves_many(
    configured: list[str] | dict[str, str] | None, inventory: list[str] | None, many: bool
) -> None:
    assert serves_many(configured, inventory) is many
