"""Heads and drafters from the Hugging Face hub, without the whole model.

    hub_ref("hub:deepseek-ai/DeepSeek-V3") -> HubRef("deepseek-ai/DeepSeek-V3", None)
    fetch_head(ref) -> Path    # the MTP head's tensors, extracted once into the cache
    fetch_repo(ref) -> Path    # a whole small repository (EAGLE-3, DFlash, Gemma 4 assistant)
    base_model_of(folder) -> "owner/name" | None   # the model a conversion was made from

`fetch_head` reads the repository's config.json and model.safetensors.index.json and downloads, with
huggingface_hub's own `hf_hub_download` (its progress bars, its cache, HF_TOKEN, HF_ENDPOINT), only the
shards that hold the head's tensors. It copies those tensors byte for byte (FP8 and BF16 as published) into
`<cache>/heads/<owner>--<name>[@rev]/mtp.safetensors` beside the repository's config.json and a
source.json (repository, commit, shards, bytes), and from then on answers from there without the network.
The head's copies of the target's embedding and output layer (DeepSeek's `embed_tokens`,
`shared_head.head`) are neither downloaded for themselves nor extracted: the target's own are used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .default import cache_dir
from .mtp_tensors import HEAD_FILE, HEAD_JSON, MissingHeadError, MTPWeightsError, copy_predicate, family_of, head_key_predicate
from .safetensors_file import copy_tensors, read_header

PREFIX = "hub:"
INDEX = "model.safetensors.index.json"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".safetensors", ".gguf", ".json", ".bin", ".pt", ".pth")


class HubError(ValueError):
    """A repository or file that could not be fetched (one line: what, from where, why)."""


@dataclass(frozen=True)
class HubRef:
    repo: str | None  # None: the target's base model (`hub` alone)
    revision: str | None = None

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo or ''}{'@' + self.revision if self.revision else ''}"


def hub_ref(value) -> HubRef | None:
    """`hub:OWNER/NAME[@REV]`, `hub` (the base model), or a bare `OWNER/NAME` that is no local path; else None."""
    if value is None:
        return None
    s = str(value)
    if s == PREFIX or (s == "hub" and not Path(s).exists()):
        return HubRef(None)
    explicit = s.startswith(PREFIX)
    if not explicit and (Path(s).expanduser().exists() or not _REPO.match(s.split("@")[0])
                         or s.endswith(_FILE_SUFFIXES)):  # a missing file, not a repository
        return None
    repo, _, rev = s[len(PREFIX):].partition("@") if explicit else s.partition("@")
    if not _REPO.match(repo):
        raise HubError(f"{s}: a hub reference is hub:OWNER/NAME or hub:OWNER/NAME@REVISION")
    return HubRef(repo, rev or None)


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # read now, not when huggingface_hub was imported


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fail(ref: HubRef, what: str, e: Exception) -> HubError:
    first = (str(e).strip().splitlines() or [""])[0]
    return HubError(f"could not fetch {what} of {ref.repo} from the hub ({type(e).__name__}: {first})")


def _download(ref: HubRef, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(ref.repo, filename, revision=ref.revision, endpoint=_endpoint()))
    except Exception as e:  # no network, no such repo or file, gated, ...
        raise _fail(ref, filename, e) from None


def _files(ref: HubRef) -> list[str]:
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=_endpoint()).list_repo_files(ref.repo, revision=ref.revision)
    except Exception as e:
        raise _fail(ref, "the file list", e) from None


def _sizes(ref: HubRef, files: list[str]) -> dict[str, int | None]:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    out = {}
    for f in files:
        try:
            out[f] = get_hf_file_metadata(hf_hub_url(ref.repo, f, revision=ref.revision, endpoint=_endpoint())).size
        except Exception:  # only for the message
            out[f] = None
    return out


def head_dir(ref: HubRef) -> Path:
    name = ref.repo.replace("/", "--") + (f"@{ref.revision}" if ref.revision else "")
    return cache_dir() / "heads" / name


def gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def fetch_head(ref: HubRef, target_config: dict | None = None, say=_say) -> Path:
    """The MTP head of `ref.repo` as a local safetensors file (HF names, bytes as published). With
    `target_config`, a repository of a model shaped otherwise is refused before any shard is fetched."""
    folder = head_dir(ref)
    if (folder / HEAD_FILE).is_file() and (folder / "source.json").is_file():
        return folder / HEAD_FILE
    files = _files(ref)
    if HEAD_FILE in files and INDEX not in files:  # a head file of its own (convert's or train-mtp's output)
        return _copy_head_file(ref, folder, files, say)
    config = json.loads(_download(ref, "config.json").read_text())
    if target_config is not None:
        check_same_model(source_fields(config), target_config, ref.repo)
    try:
        is_head, is_copy = head_key_predicate(config), copy_predicate(config)
    except MTPWeightsError as e:
        raise MissingHeadError(f"{ref.repo}: {e}") from None
    if INDEX in files:
        index = json.loads(_download(ref, INDEX).read_text())
        weight_map = index.get("weight_map") or {}
        names = {k: f for k, f in weight_map.items() if is_head(k) and not is_copy(k)}
        total = (index.get("metadata") or {}).get("total_size")
        shard_count = len(set(weight_map.values()))
    elif "model.safetensors" in files:
        names, total, shard_count = None, None, 1
    else:
        raise MissingHeadError(f"{ref.repo} holds no model.safetensors or {INDEX}: no head to fetch")
    if names is not None and not names:
        raise MissingHeadError(
            f"{ref.repo} lists no MTP head tensors in its {INDEX} ({family_of(config)} heads live under "
            f"{_where(config)}); MLX conversions strip them: take the head from the original repository")
    shards = sorted(set(names.values())) if names is not None else ["model.safetensors"]
    sizes = _sizes(ref, shards)
    known = sum(s for s in sizes.values() if s) if all(sizes.values()) else None
    say(f"MTP head of {ref.repo}: downloading {len(shards)} of {shard_count} shard(s), {gb(known)}"
        + (f" (the whole checkpoint: {gb(int(total))})" if total else ""))
    local = {f: _download(ref, f) for f in shards}
    if names is None:  # one file: its header says which tensors are the head's
        tensors, _, _ = read_header(local["model.safetensors"])
        names = {k: "model.safetensors" for k in tensors if is_head(k) and not is_copy(k)}
        if not names:
            raise MissingHeadError(f"{ref.repo}: model.safetensors holds no MTP head tensors")
    meta = {"source": ref.repo, "source_config": json.dumps(source_fields(config))}
    by_file: dict[str, list[str]] = {}
    for k, f in names.items():
        by_file.setdefault(f, []).append(k)
    written = copy_tensors([(local[f], ks) for f, ks in sorted(by_file.items())], folder / HEAD_FILE, meta)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "source.json").write_text(json.dumps({
        "repo": ref.repo, "revision": ref.revision, "commit": _commit(local[shards[0]]), "shards": shards,
        "shard_bytes": sizes, "checkpoint_bytes": total, "head_tensors": len(written),
        "head_bytes": sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0]) for v in written.values()),
    }, indent=2))
    say(f"MTP head of {ref.repo}: {len(written)} tensors kept in {folder}")
    return folder / HEAD_FILE


def _where(config: dict) -> str:
    from .config import text_config

    fam = family_of(config)
    if fam in ("qwen3_5", "qwen3_next"):
        return "mtp.*"
    if fam == "mimo":
        return "model.mtp_layers.*"
    return f"model.layers.{text_config(config).get('num_hidden_layers')}.*"


def _commit(path: Path) -> str | None:
    parts = Path(path).parts  # <cache>/models--o--n/snapshots/<commit>/<file>
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


def _copy_head_file(ref: HubRef, folder: Path, files: list[str], say) -> Path:
    say(f"MTP head of {ref.repo}: downloading its {HEAD_FILE}")
    src = _download(ref, HEAD_FILE)
    folder.mkdir(parents=True, exist_ok=True)
    if HEAD_JSON in files:
        shutil.copyfile(_download(ref, HEAD_JSON), folder / HEAD_JSON)
    shutil.copyfile(src, folder / (HEAD_FILE + ".part"))
    os.replace(folder / (HEAD_FILE + ".part"), folder / HEAD_FILE)
    (folder / "source.json").write_text(json.dumps({"repo": ref.repo, "revision": ref.revision,
                                                    "commit": _commit(src), "shards": [HEAD_FILE]}, indent=2))
    return folder / HEAD_FILE


SOURCE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")


def source_fields(config: dict) -> dict:
    """What a head must share with its target (checked at load: models/hub -> drafters/mtp/sources)."""
    from .config import text_config

    tc = text_config(config)
    return {**{k: tc.get(k) for k in SOURCE_FIELDS}, "model_type": config.get("model_type")}


def check_same_model(source: dict, target_config: dict, source_name) -> None:
    """A head from `source` (source_fields of its model) must fit the target: same family and shapes."""
    from .config import text_config
    from .mtp_tensors import FAMILIES, HeadMismatchError

    tc = text_config(target_config)
    for key, want in source.items():
        have = tc.get(key)
        if key == "model_type":
            want, have = FAMILIES.get(want, want), FAMILIES.get(target_config.get("model_type"), have)
        if want is not None and have is not None and want != have:
            raise HeadMismatchError(f"the MTP head of {source_name} is for {key} {want}; the target has {key} {have}")


def fetch_repo(ref: HubRef, what: str) -> Path:
    """A whole small repository (a drafter checkpoint), through huggingface_hub's cache."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(ref.repo, revision=ref.revision, endpoint=_endpoint(),
                                        allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"]))
    except Exception as e:
        raise _fail(ref, what, e) from None
    if not any(folder.glob("*.safetensors")):
        pickles = [f for f in _files(ref) if f.endswith((".bin", ".pt", ".pth"))]
        if pickles:  # e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: not downloaded, never unpickled
            raise HubError(f"{ref.repo} ships its weights as {', '.join(pickles[:3])} (PyTorch pickles, which this "
                           "engine does not load); use a safetensors copy of it, or save one with safetensors' "
                           "save_file(torch.load(FILE), 'model.safetensors') next to its config.json")
    return folder


def repo_of(name, path) -> str | None:
    """The hub repository a model came from: `name` when it is a repo id, else read off a path inside
    huggingface_hub's cache (<cache>/models--OWNER--NAME/snapshots/<commit>)."""
    if name is not None and not Path(str(name)).expanduser().exists() and _REPO.match(str(name)):
        return str(name)
    for part in Path(path).resolve().parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part[len("models--"):].replace("--", "/", 1)
    return None


def base_model_of(folder) -> str | None:
    """The repository a conversion was made from: `base_model` in its README.md front matter (mlx-lm and
    the hub write it there) or in its config.json; None when neither names one repository."""
    folder = Path(folder)
    names = []
    readme = folder / "README.md"
    if readme.is_file():
        from huggingface_hub.repocard import metadata_load

        try:
            names.append((metadata_load(readme) or {}).get("base_model"))
        except Exception:  # a README without valid front matter names nothing
            pass
    try:
        names.append(json.loads((folder / "config.json").read_text()).get("base_model"))
    except (OSError, ValueError, AttributeError):
        pass
    for name in names:
        if isinstance(name, list) and len(name) == 1:
            name = name[0]
        if isinstance(name, str) and _REPO.match(name):
            return name
    return None
