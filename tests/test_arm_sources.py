"""Arms of any size (docs/data.md): every byte of every arm is tokenized, streamed from
text, JSON Lines (.gz/.zst), Parquet and token files; bad records are counted, bad input is a
clear error that harms nothing; the held-out split is spread over the arm; the tokenizer can be
given; creation resumes without redoing complete arms. In-process, small files, fast."""
import gzip
import json
import logging

import numpy as np
import pytest

from proc_helpers import create_template
from shared.data.arms import ArmSourceError, parse_arm_option
from shared.data.sources import SEPARATOR, iter_text, sample_text
from shared.data.token_files import ArmData, done_marker, heldout_ranges, read_arm_index
from shared.run.config import PRESETS, ArmSpec, ConfigError, RunConfig, count_parameters
from shared.run.layout import RunLayout
from worker.data import ArmSampler

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega ").split()


def prose(n_bytes: int, seed: int = 0, mark: str = "") -> str:
    rng = np.random.default_rng(seed)
    out, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choice(WORDS, 12)) + f" {mark}é\n"
        out.append(line)
        size += len(line.encode())
    return "".join(out)


def arm_names(run):
    return read_arm_index(RunLayout(run))


def test_a_text_arm_is_tokenized_whole_every_byte_plus_separators(tmp_path, caplog):
    big = tmp_path / "big.txt"
    big.write_text(prose(3_000_000))                      # beyond the old 2,000,000 cut
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(3):
        (d / f"part{i}.txt").write_text(prose(50_000 + i, seed=i))
    with caplog.at_level(logging.INFO):
        run = create_template(tmp_path / "run", "--arm", f"big=text:{big}", "--arm", f"dir=text:{d}")
    idx = arm_names(run)
    assert idx["big"].n_tokens == big.stat().st_size      # bytes tokenizer: one token per byte
    parts = sorted(d.iterdir())
    assert idx["dir"].n_tokens == sum(p.stat().st_size for p in parts) + len(SEPARATOR) * 2
    assert idx["dir"].documents == 3
    got = np.fromfile(run / idx["big"].path, dtype=np.uint16).astype(np.uint8).tobytes()
    assert got == big.read_bytes()
    log = caplog.text
    n = big.stat().st_size
    assert f"used {n:,} of {n:,} source bytes on disk, {n:,} bytes of decoded text" in log
    assert "3 documents" in log


def test_an_explicit_cap_is_the_only_cut_and_the_log_says_how_much_of_how_much(tmp_path, caplog):
    big = tmp_path / "big.txt"
    big.write_text(prose(400_000))
    with caplog.at_level(logging.INFO):
        run = create_template(tmp_path / "run", "--arm", f"big=text:{big}",
                              "--arm-max-tokens", "100000")
    assert arm_names(run)["big"].n_tokens == 100_000
    assert "capped by --arm-max-tokens 100,000" in caplog.text
    assert json.loads((run / "run.json").read_text())["arm_max_tokens"] == 100_000


def test_jsonl_gz_and_zst_are_read_transparently_and_bad_records_are_counted(tmp_path, caplog):
    import zstandard
    recs = [json.dumps({"text": f"record {i} " + prose(300, seed=i)}) for i in range(400)]
    lines = recs[:10] + ["{not json", json.dumps({"body": "x"}), json.dumps({"text": 7})] + recs[10:]
    raw = ("\n".join(lines) + "\n").encode()
    raw = raw.replace(b'"record 20 ', b'"record 20 \xff', 1)  # undecodable bytes in one record
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    with caplog.at_level(logging.INFO):
        run = create_template(tmp_path / "run", "--arm", f"g=jsonl:{tmp_path}/a.jsonl.gz",
                              "--arm", f"z=jsonl:{tmp_path / 'b.jsonl.zst'}:text")
    idx = arm_names(run)
    good = [json.loads(r)["text"] for r in recs if not r.startswith('{"text": "record 20 ')]
    want = len(SEPARATOR.join(good).encode())
    for n in ("g", "z"):
        assert idx[n].n_tokens == want and idx[n].documents == 399
        assert idx[n].bad_records == 4
    assert idx["g"].first_bad == f"{tmp_path}/a.jsonl.gz:11: invalid JSON"
    assert "4 bad records skipped" in caplog.text and "no field 'text'" in caplog.text


def test_the_log_says_the_decoded_text_beside_the_bytes_on_disk_for_gz_and_parquet(tmp_path, caplog):
    """"used 2,636,211 of 2,636,211 source bytes" for a .gz or Parquet arm counted the file on
    disk, and the size of the text it holds was never said: it is, beside them, for every
    text, JSON Lines and Parquet arm (the documents' UTF-8 bytes, separators left out)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [prose(3_000, seed=i) + " é ü" for i in range(40)]       # non-ASCII: bytes, not chars
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress("\n".join(json.dumps({"text": t}) for t in texts).encode()))
    pq.write_table(pa.table({"body": texts}), tmp_path / "p.parquet")
    with caplog.at_level(logging.INFO):
        create_template(tmp_path / "run", "--arm", f"g=jsonl:{gz}",
                        "--arm", f"p=parquet:{tmp_path / 'p.parquet'}:body")
    for arm, size in (("g", gz.stat().st_size), ("p", (tmp_path / "p.parquet").stat().st_size)):
        line = next(ln for ln in caplog.text.splitlines() if f"arm {arm} (" in ln and "documents" in ln)
        assert f"40 documents, used {size:,} of {size:,} source bytes on disk, " \
               f"{text_bytes:,} bytes of decoded text" in line, line
        assert size < text_bytes / 2   # what the old line reported instead of the text


def test_parquet_is_streamed_by_row_group_from_a_directory(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path / "pq"
    d.mkdir()
    docs = []
    for f in range(2):
        col = [f"doc {f}-{i}: " + prose(200, seed=i) for i in range(300)]
        docs += col
        pq.write_table(pa.table({"id": list(range(300)), "body": col}), d / f"s{f}.parquet",
                       row_group_size=50)
    run = create_template(tmp_path / "run", "--arm", f"p=parquet:{d}:body")
    a = arm_names(run)["p"]
    assert a.n_tokens == len(SEPARATOR.join(docs).encode()) and a.documents == 600
    got = np.fromfile(run / a.path, dtype=np.uint16).astype(np.uint8).tobytes().decode()
    assert got == SEPARATOR.join(docs)


def test_token_arms_accept_uint16_and_uint32_and_refuse_ids_outside_the_vocabulary(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 30_000).astype(np.uint16).tofile(tmp_path / "a.u16")
    rng.integers(0, 256, 30_000).astype(np.uint32).tofile(tmp_path / "b.u32")
    run = create_template(tmp_path / "run", "--arm", f"a=tokens:{tmp_path / 'a.u16'}",
                          "--arm", f"b=tokens:{tmp_path / 'b.u32'}:u32")
    idx = arm_names(run)
    assert (idx["a"].dtype, idx["b"].dtype) == ("uint16", "uint32")
    assert np.array_equal(idx["b"].tokens(run), np.fromfile(tmp_path / "b.u32", np.uint32))
    s = ArmSampler(run, idx, 32)
    assert s.draw(1, 1, {"a": 0.5, "b": 0.5}, 8).x.max() < 256
    bad = rng.integers(0, 256, 30_000).astype(np.uint16)
    bad[12_345] = 300
    bad.tofile(tmp_path / "c.u16")
    with pytest.raises(ArmSourceError, match=r"c\.u16 holds token id 300 at token 12,345"):
        create_template(tmp_path / "run2", "--arm", f"c=tokens:{tmp_path / 'c.u16'}")
    (tmp_path / "d.u16").write_bytes(b"\0" * 30_001)
    with pytest.raises(ArmSourceError, match=r"d\.u16 is 30,001 bytes, not a whole number"):
        create_template(tmp_path / "run3", "--arm", f"d=tokens:{tmp_path / 'd.u16'}")
    assert not (tmp_path / "run2" / "run.json").exists()


def test_a_token_files_width_is_read_from_its_name_and_a_contradiction_is_refused(tmp_path):
    """A tokens arm's width comes from its file name (`.u32` is read as uint32, not as the
    vocabulary's uint16, which would put a zero after every id, all inside the vocabulary); a name
    that contradicts the dtype given, or files of two widths in one arm, are refused before
    anything is written; a name without a width keeps the vocabulary's."""
    ids = np.tile(np.arange(256, dtype=np.uint32), 200)
    ids.tofile(tmp_path / "wide.u32")
    ids.astype(np.uint16).tofile(tmp_path / "narrow.bin")
    run = create_template(tmp_path / "run", "--arm", f"w=tokens:{tmp_path / 'wide.u32'}",
                          "--arm", f"n=tokens:{tmp_path / 'narrow.bin'}")
    idx = arm_names(run)
    assert (idx["w"].dtype, idx["n"].dtype) == ("uint32", "uint16")
    assert np.array_equal(idx["w"].tokens(run), ids)
    with pytest.raises(ArmSourceError, match=r"dtype uint16 was given but .*wide\.u32 is named "
                                              r"\.u32 \(uint32\); give the dtype its name says"):
        create_template(tmp_path / "run2", "--arm", f"w=tokens:{tmp_path / 'wide.u32'}:u16")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    ids.tofile(mixed / "a.u32")
    ids.astype(np.uint16).tofile(mixed / "b.u16")
    with pytest.raises(ArmSourceError, match=r"different widths by their names"):
        create_template(tmp_path / "run3", "--arm", f"m=tokens:{mixed}")
    assert not (tmp_path / "run2" / "run.json").exists()
    assert not (tmp_path / "run3" / "run.json").exists()


def test_an_arm_left_empty_by_a_wrong_field_or_a_small_cap_names_the_real_fix(tmp_path):
    """An arm left empty names its real fix: a JSONL arm whose text is under another field
    names the fields its records have, and a run with --arm-max-tokens too small names the cap
    (not "0 tokens is too small; give it more text")."""
    src = tmp_path / "chats.jsonl"
    with open(src, "w") as f:
        for i in range(40):
            f.write(json.dumps({"id": i, "body": prose(400, seed=i)}) + "\n")
    with pytest.raises(ArmSourceError, match=r"none of the first 40 records has a text field "
                                              r"'text' \(they have fields 'body', 'id'\); name the "
                                              r"text's field: --arm c=jsonl:.*chats\.jsonl:FIELD"):
        create_template(tmp_path / "run", "--arm", f"c=jsonl:{src}")
    with pytest.raises(ArmSourceError, match=r"raise --arm-max-tokens \(now 50\)"):
        create_template(tmp_path / "run2", "--arm", f"c=jsonl:{src}:body", "--arm-max-tokens", "50")
    run = create_template(tmp_path / "run3", "--arm", f"c=jsonl:{src}:body")
    assert arm_names(run)["c"].documents == 40


@pytest.mark.parametrize("cut", ["mid-frame", "single-frame", "multi-frame-mid"])
def test_a_truncated_zst_is_refused_naming_the_file_like_a_truncated_gz(tmp_path, cut):
    """zstandard's stream reader ends quietly at a cut inside a frame: the arm trained on part of
    its file (half the documents, one 'invalid JSON') or read as empty ('give it more text')."""
    import zstandard
    lines = [json.dumps({"text": prose(200, i)}) + "\n" for i in range(2000)]
    raw = "".join(lines).encode()
    if cut == "multi-frame-mid":   # several frames (as `zstd` writes large files); cut in the 3rd
        frames = [zstandard.ZstdCompressor().compress("".join(lines[i:i + 400]).encode())
                  for i in range(0, 2000, 400)]
        blob = b"".join(frames)
        blob = blob[:sum(map(len, frames[:2])) + len(frames[2]) // 2]
    else:
        c = zstandard.ZstdCompressor()
        if cut == "mid-frame":    # a streamed frame (no content size), cut at a line's worth
            buf = __import__("io").BytesIO()
            with c.stream_writer(buf, closefd=False) as w:
                w.write(raw)
            blob = buf.getvalue()
        else:
            blob = c.compress(raw)
        blob = blob[:len(blob) // 2]
    src = tmp_path / "t.jsonl.zst"
    src.write_bytes(blob)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"arm x: .*t\.jsonl\.zst is corrupt or truncated"):
        create_template(run, "--arm", f"x=jsonl:{src}")
    assert not (run / "run.json").exists()


def test_whole_zst_files_of_several_frames_read_every_record(tmp_path):
    import zstandard
    lines = [json.dumps({"text": prose(200, i)}) + "\n" for i in range(900)]
    blob = b"".join(zstandard.ZstdCompressor().compress("".join(lines[i:i + 300]).encode())
                    for i in range(0, 900, 300))
    (tmp_path / "m.jsonl.zst").write_bytes(blob)
    run = create_template(tmp_path / "run", "--arm", f"m=jsonl:{tmp_path / 'm.jsonl.zst'}")
    assert arm_names(run)["m"].documents == 900 and arm_names(run)["m"].bad_records == 0


def test_a_glob_that_matches_directories_reads_their_files(tmp_path):
    for d in ("notes-a", "notes-b"):
        (tmp_path / d / "sub").mkdir(parents=True)
        (tmp_path / d / "sub" / "x.txt").write_text(prose(40_000, seed=len(d), mark=d))
        (tmp_path / d / ".hidden.txt").write_text("secret")
    run = create_template(tmp_path / "run", "--arm", f"n=text:{tmp_path}/notes-*")
    assert arm_names(run)["n"].documents == 2
    (tmp_path / "none-x").mkdir()
    with pytest.raises(ConfigError, match=r"matches only directories with no file"):
        create_template(tmp_path / "run2", "--arm", f"n=text:{tmp_path}/none-*")


def test_a_text_arm_counts_the_undecodable_bytes_it_replaced(tmp_path, caplog):
    """A text arm keeps undecodable bytes as U+FFFD; the log counts the bytes and says they were
    replaced (bytes, not records or 1 MiB chunks)."""
    good = prose(200_000).encode()
    junk = bytes([0xff, 0xfe, 0x80]) * 1000            # 3,000 bytes that are never UTF-8
    (tmp_path / "a.txt").write_bytes(good[:100_000] + junk + good[100_000:])
    with caplog.at_level(logging.INFO):
        create_template(tmp_path / "run", "--arm", f"a=text:{tmp_path / 'a.txt'}",
                        "--tokenizer", "bytes")
    assert "3,000 undecodable bytes replaced by U+FFFD" in caplog.text, caplog.text[-2000:]
    assert "bad records skipped" not in caplog.text


@pytest.mark.parametrize("case,words", [
    ("missing", "matches no file"), ("empty", "directory"), ("nocol", "has no column 'text'"),
    ("corrupt", "is corrupt or truncated"), ("tiny", "too small")])
def test_bad_input_is_a_clear_error_naming_the_arm_and_file_and_harms_nothing(tmp_path, case, words):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = tmp_path / "good.txt"
    good.write_text(prose(60_000))
    src = {"missing": f"x=text:{tmp_path}/nope*.txt", "empty": f"x=text:{tmp_path / 'empty'}",
           "nocol": f"x=parquet:{tmp_path / 't.parquet'}", "corrupt": f"x=jsonl:{tmp_path / 'c.jsonl.gz'}",
           "tiny": f"x=text:{tmp_path / 'tiny.txt'}"}[case]
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "t.parquet")
    blob = gzip.compress(("\n".join(json.dumps({"text": prose(200, i)}) for i in range(2000))).encode())
    (tmp_path / "c.jsonl.gz").write_bytes(blob[:len(blob) // 2])
    (tmp_path / "tiny.txt").write_text("hi")
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=words) as e:
        create_template(run, "--arm", f"good=text:{good}", "--arm", src)
    assert "arm x" in str(e.value)
    assert not (run / "run.json").exists() and not list(run.glob("data/x.*"))


def test_the_held_out_split_is_spread_over_the_arm_and_never_drawn(tmp_path):
    cfg = RunConfig(model=PRESETS["andrea-test"])
    n = 50_000
    ranges = heldout_ranges(n, cfg)
    assert len(ranges) == cfg.probe_sequences and ranges[0][0] < n // 4 and ranges[-1][1] == n
    toks = np.arange(n, dtype=np.uint32)                   # each token is its position
    for a, b in ranges:
        toks[a:b] = 10**6
    toks.tofile(tmp_path / "t.u32")
    a = ArmData("t", "tokens", "", "", str(tmp_path / "t.u32"), n, ranges[0][0],
                heldout=[list(r) for r in ranges], dtype="uint32")
    s = ArmSampler(tmp_path, {"t": a}, 32)
    seen = set()
    for k in range(1, 300):
        b = s.draw(3, k, {"t": 1.0}, 8)
        assert int(b.x.max()) < 10**6 and int(b.y.max()) < 10**6
        seen.update((b.x[:, 0].numpy() // (n // 8)).tolist())
    assert seen == set(range(8))                           # training windows from all over
    assert (s.heldout_windows("t", 8) == 10**6).all()
    # a run made before (one tail range): the draw is exactly the old formula, bit for bit
    old = ArmData("t", "tokens", "", "", str(tmp_path / "t.u32"), n, n - 2500, dtype="uint32")
    from worker.data import step_generator
    s2 = ArmSampler(tmp_path, {"t": old}, 32)
    g = step_generator(5, 9)
    g.choice(1, size=4, p=[1.0])
    want = [int(g.integers(0, n - 2500 - 32 - 1)) for _ in range(4)]
    b = s2.draw(5, 9, {"t": 1.0}, 4)
    assert np.array_equal(b.x.numpy(), np.stack([toks[w:w + 32] for w in want]).astype(np.int64))


def test_the_bpe_sample_is_bounded_and_drawn_from_across_the_arm(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("".join(prose(100_000, seed=i, mark=f"PART{i:02d}") for i in range(20)))
    arm = ArmSpec("t", "text", str(f))
    s = sample_text(arm, 200_000, piece=10_000)
    total = sum(map(len, s))
    assert 150_000 <= total <= 210_000
    joined = "".join(s)
    assert sum(f"PART{i:02d}" in joined for i in range(20)) >= 18
    assert sample_text(arm, 200_000, piece=10_000) == s    # deterministic


def test_bpe_run_states_its_sample_and_resume_keeps_complete_arms(tmp_path, caplog):
    f = tmp_path / "t.txt"
    f.write_text(prose(300_000))
    g = tmp_path / "u.txt"
    g.write_text(prose(200_000, seed=3))
    args = ["--tokenizer", "bpe", "--bpe-sample-bytes", "100000", "--arm", f"t=text:{f}",
            "--arm", f"u=text:{g}"]
    with caplog.at_level(logging.INFO):
        run = create_template(tmp_path / "run", *args)
    assert "BPE sample: 100,000 characters" in caplog.text
    assert json.loads((run / "run.json").read_text())["bpe_sample_bytes"] == 100_000
    # an interrupted creation: run.json and u's token file missing, t complete
    idx = arm_names(run)
    st = (run / idx["t"].path).stat()
    (run / "run.json").unlink()
    (run / idx["u"].path).unlink()
    (run / "data" / "u.u16.tmp").write_bytes(b"partial")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        create_template(run, *args)
    assert "tokenizer: kept" in caplog.text and "arm t: already complete" in caplog.text
    st2 = (run / idx["t"].path).stat()
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert arm_names(run)["u"].n_tokens == idx["u"].n_tokens
    assert not (run / "data" / "u.u16.tmp").exists()
    assert done_marker(RunLayout(run), "u").exists()


def _big_vocab_tokenizer(path, size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for i in range(len(vocab), size):
        vocab[f"<x{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return path


def test_an_existing_tokenizer_json_is_used_and_sets_the_exact_model_size(tmp_path, caplog):
    assert count_parameters(PRESETS["andrea-120m"], 50_257) == 163_037_184
    cfg = RunConfig(preset="andrea-120m", model=PRESETS["andrea-120m"], vocab_size=50_257)
    assert cfg.checkpoint_bytes == 8 + 12 * 163_037_184
    f = tmp_path / "t.txt"
    f.write_text(prose(60_000))
    tj = _big_vocab_tokenizer(tmp_path / "gpt2ish.json", 50_257)
    with caplog.at_level(logging.INFO):
        run = create_template(tmp_path / "run", "--tokenizer", str(tj), "--arm", f"t=text:{f}")
    rc = json.loads((run / "run.json").read_text())
    assert rc["vocab_size"] == 50_257 and rc["n_params"] == count_parameters(PRESETS["andrea-test"], 50_257)
    assert "with 50257 tokens" in caplog.text and arm_names(run)["t"].dtype == "uint16"
    big = _big_vocab_tokenizer(tmp_path / "big.json", 70_000)
    run2 = create_template(tmp_path / "run2", "--tokenizer", str(big), "--arm", f"t=text:{f}")
    a = arm_names(run2)["t"]
    assert a.dtype == "uint32" and a.path.endswith(".u32") and a.tokens(run2).dtype == np.uint32


def test_arm_option_forms():
    assert parse_arm_option("p=parquet:/d/shards/*.parquet:body") == \
        ArmSpec("p", "parquet", "/d/shards/*.parquet", "body")
    assert parse_arm_option("p=parquet:/d/x.parquet").field == "text"
    assert parse_arm_option("t=tokens:/d/x.bin:u32").dtype == "uint32"
    assert parse_arm_option("c=jsonl:/d/c.jsonl.zst:content").field == "content"
    with pytest.raises(ConfigError, match="kind 'csv' unknown"):
        parse_arm_option("c=csv:/d/c.csv")


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log(caplog):
    import io

    from shared.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    t = Tty()
    p = Progress("arm x", 10_000_000, stream=t)
    p.update(5_000_000)
    p.close()
    assert "arm x" in t.getvalue() and "5.00M" in t.getvalue()
    with caplog.at_level(logging.INFO):
        p = Progress("arm y", 10_000_000, stream=io.StringIO(), every=0)
        p.update(4_000_000)
        p.close()
    assert "arm y: 4.0 MB of 10.0 MB (40 %)" in caplog.text and "MB/s, ETA" in caplog.text


def test_empty_documents_are_skipped_counted_and_named_in_the_creation_log(tmp_path, caplog):
    """An empty file, record or row adds no text and no separator, and the creation log counts
    and names the empty documents (an empty text file included)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    d = tmp_path / "txt"
    d.mkdir()
    (d / "a.txt").write_text(prose(5_000, seed=1))
    (d / "b.txt").write_text("")
    (d / "c.txt").write_text(prose(5_000, seed=2))
    texts = [prose(300, seed=i) for i in range(200)]
    with open(tmp_path / "r.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t}) + "\n")
            if i % 50 == 0:
                f.write(json.dumps({"text": ""}) + "\n")
    col = [t if i % 40 else "" for i, t in enumerate(texts)]
    pq.write_table(pa.table({"text": col}), tmp_path / "p.parquet", row_group_size=64)
    with caplog.at_level(logging.INFO):
        run = create_template(tmp_path / "run", "--arm", f"t=text:{d}",
                              "--arm", f"j=jsonl:{tmp_path / 'r.jsonl'}",
                              "--arm", f"p=parquet:{tmp_path / 'p.parquet'}")
    idx = arm_names(run)
    parts = [(d / "a.txt").read_text(), (d / "c.txt").read_text()]
    assert (idx["t"].documents, idx["t"].empty_documents) == (2, 1)
    assert idx["t"].n_tokens == len(SEPARATOR.join(parts).encode())
    assert (idx["j"].documents, idx["j"].empty_documents) == (200, 4)
    assert idx["j"].n_tokens == len(SEPARATOR.join(texts).encode())
    assert (idx["p"].documents, idx["p"].empty_documents) == (195, 5)
    assert idx["p"].n_tokens == len(SEPARATOR.join(c for c in col if c).encode())
    log = caplog.text
    assert "(1 empty document skipped)" in log and "(4 empty documents skipped)" in log
    assert "(5 empty documents skipped)" in log


def test_a_token_file_used_in_place_and_capped_opens_its_head_and_a_shorter_one_is_refused(tmp_path):
    """A tokens arm of one file is used where it lies; with --arm-max-tokens only its head is the
    arm's, so the file is longer than n_tokens and the run is created; a file shorter than the
    arm's n_tokens is refused."""
    toks = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint16)
    toks.tofile(tmp_path / "t.u16")
    run = create_template(tmp_path / "run", "--arm", f"t=tokens:{tmp_path / 't.u16'}",
                          "--arm-max-tokens", "30000")
    a = arm_names(run)["t"]
    assert a.n_tokens == 30_000 and np.array_equal(a.tokens(run), toks[:30_000])
    (tmp_path / "t.u16").write_bytes(toks[:20_000].tobytes())   # cut below the arm's head
    with pytest.raises(ArmSourceError, match=r"t\.u16 has 40,000 bytes"):
        a.tokens(run)


def test_two_arms_of_the_same_source_are_named_in_a_warning(tmp_path, caplog):
    """foo=python-code beside the default repo-code was accepted without a word: that data
    counted twice in the mixture."""
    src = tmp_path / "a.txt"
    src.write_text(prose(60_000))
    with caplog.at_level(logging.INFO):
        create_template(tmp_path / "run", "--arm", f"a=text:{src}", "--arm", f"b=text:{src}",
                        "--arm", f"c=text:{tmp_path}/*.txt")
    assert "arms a and b read the same source" in caplog.text
    assert "arms a and c" in caplog.text    # the glob matches the same one file


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_the_bpe_sample_budget_counts_characters_of_a_compressed_arm(tmp_path, suffix):
    """A 1.37 MB .zst arm gave 5.96 MB of text against a budget of 2.67 M characters: its size
    on disk was compared with the budget. The budget counts characters whatever the encoding."""
    import zstandard
    lines = "".join(json.dumps({"text": prose(2_000, seed=i % 7)}) + "\n" for i in range(600))
    raw = lines.encode()
    data = gzip.compress(raw) if suffix.endswith("gz") else zstandard.ZstdCompressor().compress(raw)
    (tmp_path / f"a{suffix}").write_bytes(data)
    assert len(data) < 300_000 < len(raw)          # small on disk, large as text
    arm = parse_arm_option(f"a=jsonl:{tmp_path / f'a{suffix}'}")
    s = sample_text(arm, 300_000, piece=10_000)
    assert 250_000 <= sum(map(len, s)) <= 300_000
    small = sample_text(arm, 5_000_000)            # it fits: taken whole
    assert small == ["".join(iter_text(arm))]
