"""The Kubernetes manifests under examples/kubernetes/ are valid for the Kubernetes API and agree
with themselves and with pitstop-run's command line. Each document is checked, strictly (no
field the API does not know), against the JSON schema of Kubernetes 1.37 that kubernetes-validate
bundles, offline; each Job that runs pitstop-run is checked for what the schema cannot see: node
count, node rank, master address, restarts, token and checkpoint volume. Nothing here applies a
manifest to a cluster, and nothing of the project is imported."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

MANIFESTS = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
REPO_ROOT = MANIFESTS.parent.parent
KUBERNETES = "1.37.0"
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

Doc = dict[str, Any]


def _load() -> list[tuple[str, list[Doc]]]:
    files = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        files.append((path.name, docs))
    return files


FILES = _load()
DOCUMENTS = [
    pytest.param(doc, id=f"{name}#{i}-{doc['kind']}/{doc['metadata']['name']}")
    for name, docs in FILES
    for i, doc in enumerate(docs)
]


def _launches(doc: Doc) -> bool:
    if doc["kind"] != "Job":
        return False
    containers = doc["spec"]["template"]["spec"]["containers"]
    return any(c.get("command", [""])[0] == "pitstop-run" for c in containers)


# Each Job that runs pitstop-run, with the other documents of its file.
JOBS = [
    pytest.param(doc, docs, id=f"{name}-{doc['metadata']['name']}")
    for name, docs in FILES
    for doc in docs
    if _launches(doc)
]


def _launcher_parser() -> argparse.ArgumentParser:
    """The flags of pitstop-run (torchrun's and Pitstop's) that the manifests use."""
    p = argparse.ArgumentParser(prog="pitstop-run", allow_abbrev=False, exit_on_error=False)
    for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr"):
        p.add_argument(flag)
    for flag in ("--master-port", "--max-restarts"):
        p.add_argument(flag, type=int)
    for flag in ("--server", "--job", "--token"):
        p.add_argument(flag)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _container(job: Doc) -> Doc:
    containers: list[Doc] = job["spec"]["template"]["spec"]["containers"]
    [container] = [c for c in containers if c.get("command") == ["pitstop-run"]]
    return container


def _args(job: Doc) -> argparse.Namespace:
    return _launcher_parser().parse_args(_container(job)["args"])


def _env(job: Doc) -> dict[str, Doc]:
    return {var["name"]: var for var in _container(job).get("env", [])}


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    [found] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_there_are_manifests() -> None:
    assert FILES, f"no *.yaml under {MANIFESTS}"
    assert JOBS, "no Job runs pitstop-run"


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_valid_for_kubernetes(doc: Doc) -> None:
    assert kubernetes_validate.validate(doc, KUBERNETES, strict=True) == "1.37"


def _misspelt(job: Doc) -> None:
    job["spec"]["completionsMode"] = job["spec"].pop("completionMode")


def _wrong_type(job: Doc) -> None:
    job["spec"]["completions"] = "two"


def _misspelt_in_container(job: Doc) -> None:
    env = _container(job)["env"]
    [token] = [var for var in env if var["name"] == "PITSTOP_AGENT_TOKEN"]
    token["valueFrom"]["secretKeyRefs"] = token["valueFrom"].pop("secretKeyRef")


@pytest.mark.parametrize("spoil", [_misspelt, _wrong_type, _misspelt_in_container])
@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_the_validator_rejects_a_broken_job(
    job: Doc, docs: list[Doc], spoil: Callable[[Doc], None]
) -> None:
    broken = copy.deepcopy(job)
    spoil(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_runs_the_launcher_on_a_script_of_the_repository(job: Doc, docs: list[Doc]) -> None:
    container = _container(job)
    assert container["command"] == ["pitstop-run"]
    args = _args(job)
    # the image holds the repository's examples/ under its working directory
    assert container["workingDir"] == "/workspace"
    assert (REPO_ROOT / args.training_script).is_file()
    assert args.server.startswith("ws://") and args.job


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_one_pod_a_node(job: Doc, docs: list[Doc]) -> None:
    spec = job["spec"]
    assert int(_args(job).nnodes) == spec["completions"] == spec["parallelism"]


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_node_rank_is_the_completion_index(job: Doc, docs: list[Doc]) -> None:
    assert job["spec"]["completionMode"] == "Indexed"
    assert _args(job).node_rank == "$(JOB_COMPLETION_INDEX)"
    # $(VAR) in args is expanded only for a variable the container declares
    index = _env(job)["JOB_COMPLETION_INDEX"]
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_master_is_pod_zero_of_the_headless_service(job: Doc, docs: list[Doc]) -> None:
    pod = job["spec"]["template"]
    subdomain = pod["spec"]["subdomain"]
    service = _one(docs, "Service", subdomain)
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"]
    assert selector and selector.items() <= pod["metadata"]["labels"].items()
    args = _args(job)
    assert args.master_addr == f"{job['metadata']['name']}-0.{subdomain}"
    ports = [p["containerPort"] for p in _container(job).get("ports", [])]
    assert args.master_port in ports


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_pitstop_restarts_not_kubernetes(job: Doc, docs: list[Doc]) -> None:
    spec = job["spec"]
    assert "backoffLimit" not in spec  # it would fail the whole Job at the first lost pod
    assert spec["backoffLimitPerIndex"] >= 1  # a lost pod comes back with its node rank
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert _args(job).max_restarts > 0
    # the launcher's exit 1 (its restarts spent) ends the Job rather than a retry
    (gives_up,) = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert gives_up["onExitCodes"] == {
        "containerName": _container(job)["name"],
        "operator": "In",
        "values": [1],
    }


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_token_comes_from_a_secret(job: Doc, docs: list[Doc]) -> None:
    assert _args(job).token is None, "a token on the command line shows in ps"
    ref = _env(job)["PITSTOP_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]
    secrets = [d for d in docs if d["kind"] == "Secret"]
    if secrets:  # the file's own Secret, if it has one, is the one named
        secret = _one(docs, "Secret", ref["name"])
        assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}


@pytest.mark.parametrize(("job", "docs"), JOBS)
def test_checkpoints_on_a_volume_every_node_shares(job: Doc, docs: list[Doc]) -> None:
    """torchrun_ddp.py's rank 0 writes the checkpoint that every rank resumes from."""
    script = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    script.add_argument("--checkpoint-dir", required=True)
    checkpoints = script.parse_known_args(_args(job).training_script_args)[0].checkpoint_dir
    [mount] = [
        m
        for m in _container(job)["volumeMounts"]
        if Path(checkpoints).is_relative_to(m["mountPath"])
    ]
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in _one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"]
