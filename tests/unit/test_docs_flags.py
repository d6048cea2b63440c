"""The docs stay honest about the command lines: every `--flag` that README.md and docs/ name is a flag of
pretrain_gpt.py or of one of the repository's tools, benches and scripts (or of the named external command), every
repository path they name exists, and every relative link resolves (to a file, and to a heading where it names
one)."""
from __future__ import annotations

import re

from megatron.arguments import build_parser
from megatron.compat import NOOP_FLAGS
from tests.support.config import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "guides").glob("*.md"))]
# Flags of the commands the docs show around ours, and flags named as what is not accepted.
EXTERNAL = {
    "torchrun": {"--nnodes", "--nproc_per_node", "--nproc-per-node", "--node_rank", "--master_addr", "--master_port",
                 "--max-restarts", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"},
    "sbatch and srun (docs/reliability.md)": {"--requeue", "--dependency", "--kill-on-bad-exit"},
    "deepspeed launcher": {"--hostfile", "--include", "--num_gpus", "--num_nodes", "--num_accelerators", "--no_ssh",
                           "--no_local_rank", "--bind_cores_to_rank", "--master_port"},
    "pytest, numactl, every CLI": {"--dist", "--durations", "--hardware", "--help"},
    "Megatron-Core flags refused here (docs/memory.md)": {"--main-grads-dtype", "--main-params-dtype"},
    "a mistyped flag, the example of the hint (docs/guides/migrate.md)": {"--num-layer"},
    "Megatron-LM flags to edit (docs/guides/migrate.md)": {
        "--group-query-attention", "--use-distributed-optimizer", "--transformer-impl", "--use-mcore-models",
        "--use-flash-attn", "--attention-softmax-in-fp32", "--overlap-grad-reduce"},
    "bench/bench_zero3_build.py (parsed by hand: the rest of its command line is pretrain_gpt.py's)": {"--tree"},
}
# Folders that the GPU and Gaudi checks create for their reports; files of the upstream repositories.
NOT_IN_THE_TREE = {"docs/gpu", "docs/gaudi", "scripts/run_llama.sh", "scripts/run_llama2_7b_fp8.sh"}


def _defined_flags() -> set[str]:
    # pretrain_gpt.py's parser is generated from the config fields (megatron/flagspec.py): read it built
    flags = set(NOOP_FLAGS).union(*(action.option_strings for action in build_parser()._actions))
    sources = [*REPO.glob("megatron/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("bench/*.py"),
               *REPO.glob("scripts/*.py"), REPO / "pretrain_gpt.py"]
    for path in sources:
        for call in re.finditer(r"add_argument\((.*?)\)\n", path.read_text(), re.S):
            names = re.findall(r'"(--[a-zA-Z0-9_-]+)"', call.group(1).split("help=")[0])
            flags.update(names)
            if "BooleanOptionalAction" in call.group(1):
                flags.update("--no-" + n[2:] for n in names)
    for path in [*REPO.glob("scripts/*.sh"), *REPO.glob("examples/*.sh")]:
        flags.update(re.findall(r"(--[a-z0-9][a-z0-9-]+)\)", path.read_text()))  # a shell `case` of its options
    return flags


def test_every_flag_the_docs_name_exists():
    known = _defined_flags().union(*EXTERNAL.values())
    unknown = {}
    for doc in DOCS:
        for flag in re.findall(r"(?<![\w/-])(--[a-zA-Z][a-zA-Z0-9_-]*)", doc.read_text()):
            if flag not in known:
                unknown.setdefault(flag, set()).add(doc.name)
    assert not unknown, unknown


def test_every_repository_path_the_docs_name_exists():
    missing = {}
    for doc in DOCS:
        pattern = r"(?<![\w/.-])((?:megatron|tools|bench|scripts|tests|examples|docs)/[\w./-]*\w)"
        for path in re.findall(pattern, doc.read_text()):
            if path not in NOT_IN_THE_TREE and not (REPO / path).exists():
                missing.setdefault(path, set()).add(doc.name)
    assert not missing, missing


def _anchors(doc) -> set[str]:
    """The anchors GitHub makes of a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    broken = {}
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.setdefault(str(doc.relative_to(REPO)), []).append(target)
    assert not broken, broken
