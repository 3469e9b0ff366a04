"""OpenFold's and FastFold's command lines under `suite fold` (issue 21): every flag of their inference scripts is
accepted with its meaning or refused with one line saying why; and bad input is one line, exit 2, before any
work (parameter files, model names, devices, seeds, Ray addresses, alignment folders)."""

from __future__ import annotations

import argparse
import json
import socket
import zipfile
from pathlib import Path

import pytest

from lowmem.suite.cli import build_parser, main
from lowmem.suite.errors import UsageError

ASSETS = Path(__file__).parents[1] / "assets" / "fold"

OPENFOLD = [  # run_pretrained_openfold.py, with OpenFold's add_data_args
    "--use_precomputed_alignments", "--use_custom_template", "--use_single_seq_mode", "--output_dir",
    "--model_device", "--config_preset", "--jax_param_path", "--openfold_checkpoint_path", "--save_outputs",
    "--cpus", "--preset", "--output_postfix", "--data_random_seed", "--skip_relaxation", "--multimer_ri_gap",
    "--trace_model", "--subtract_plddt", "--long_sequence_inference", "--cif_output", "--experiment_config_json",
    "--use_deepspeed_evoformer_attention",
    "--uniref90_database_path", "--mgnify_database_path", "--pdb70_database_path", "--pdb_seqres_database_path",
    "--uniref30_database_path", "--uniclust30_database_path", "--uniprot_database_path", "--bfd_database_path",
    "--jackhmmer_binary_path", "--hhblits_binary_path", "--hhsearch_binary_path", "--hmmsearch_binary_path",
    "--hmmbuild_binary_path", "--kalign_binary_path", "--max_template_date", "--obsolete_pdbs_path",
    "--release_dates_path",
]
FASTFOLD = [  # FastFold's inference.py, with its add_data_args
    "--use_precomputed_alignments", "--output_dir", "--model_name", "--param_path", "--relaxation", "--cpus",
    "--gpus", "--preset", "--save_prediction_result", "--data_random_seed", "--model_preset", "--chunk_size",
    "--enable_workflow", "--inplace",
    "--uniref90_database_path", "--mgnify_database_path", "--pdb70_database_path", "--uniref30_database_path",
    "--bfd_database_path", "--pdb_seqres_database_path", "--uniprot_database_path", "--jackhmmer_binary_path",
    "--hhblits_binary_path", "--hhsearch_binary_path", "--kalign_binary_path", "--hmmsearch_binary_path",
    "--hmmbuild_binary_path", "--max_template_date", "--obsolete_pdbs_path", "--release_dates_path",
]

# flag -> (value given, {suite fold attribute: value it must get}); {} for a flag that only needs to be accepted
ACCEPTED = {
    "--config_preset": ("model_3", {"model_name": "model_3"}),
    "--model_name": ("model_2", {"model_name": "model_2"}),
    "--jax_param_path": ("p.npz", {"param_path": "p.npz"}),
    "--openfold_checkpoint_path": ("c.pt", {"param_path": "c.pt"}),
    "--param_path": ("p.npz", {"param_path": "p.npz"}),
    "--skip_relaxation": (None, {"relax": False}),
    "--relaxation": (None, {"relax": True}),
    "--data_random_seed": ("7", {"seed": 7}),
    "--long_sequence_inference": (None, {"chunk_size": "auto"}),
    "--chunk_size": ("4", {"chunk_size": 4}),
    "--uniclust30_database_path": ("db", {"uniref30_database_path": "db"}),
    "--uniref30_database_path": ("db", {"uniref30_database_path": "db"}),
    "--gpus": ("2", {"devices": 2}),
    "--enable_workflow": (None, {"num_workers": lambda v: v >= 1}),
    "--inplace": (None, {"inplace": True}),
    "--subtract_plddt": (None, {"subtract_plddt": True}),
    "--model_preset": ("monomer", {}),
    "--preset": ("full_dbs", {}),
    "--cif_output": (None, {"cif_output": True}),
    "--multimer_ri_gap": ("200", {"multimer_ri_gap": 200}),  # OpenFold's default; issue 48
    "--save_outputs": (None, {"save_outputs": True}),
    "--save_prediction_result": ("True", {"save_outputs": True}),
    "--model_device": ("cpu", {"model_device": "cpu"}),
    "--use_precomputed_alignments": ("dir", {"use_precomputed_alignments": "dir"}),
    "--output_dir": ("o", {"output_dir": "o"}),
    "--cpus": ("3", {"cpus": 3}),
    "--max_template_date": ("2020-01-01", {"max_template_date": "2020-01-01"}),
    **{f"--{db}_database_path": ("db", {f"{db}_database_path": "db"}) for db in ("uniref90", "mgnify", "pdb70",
                                                                               "bfd")},
    **{f"--{tool}_binary_path": ("x", {f"{tool}_binary_path": "x"}) for tool in ("jackhmmer", "hhblits",
                                                                                "hhsearch", "kalign")},
    "--obsolete_pdbs_path": ("obsolete.dat", {"obsolete_pdbs_path": "obsolete.dat"}),
    # multimer-only inputs: OpenFold's monomer runs ignore them too (a warning says so)
    **{f"--{f}": ("x", {}) for f in ("uniprot_database_path", "pdb_seqres_database_path", "hmmsearch_binary_path",
                                     "hmmbuild_binary_path")},
}
REFUSED = {  # flag -> (value, words the one line must hold)
    "--use_single_seq_mode": (None, "SoloSeq"),
    "--output_postfix": ("x", "cannot apply"),
    "--trace_model": (None, "TorchScript"),
    "--use_deepspeed_evoformer_attention": (None, "DeepSpeed"),
    "--use_custom_template": (None, "not supported"),
    "--experiment_config_json": ("c.json", "cannot apply"),
    "--release_dates_path": ("dates.txt", "not needed"),
}


def _parse(tmp_path: Path, extra: list[str]) -> argparse.Namespace:
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMKTAYIAK\n")
    argv = ["fold", str(fasta), *extra]
    return build_parser(argv).parse_args(argv)


def _argv(flag: str, value: str | None) -> list[str]:
    return [flag] if value is None else [flag, value]


@pytest.mark.parametrize("flag", sorted(set(OPENFOLD) | set(FASTFOLD)))
def test_every_openfold_and_fastfold_flag_is_accepted_with_its_meaning_or_refused(tmp_path, flag):
    from lowmem.suite.commands.fold_compat import apply_compat

    assert (flag in ACCEPTED) != (flag in REFUSED), f"{flag}: neither accepted with a meaning nor refused"
    if flag in ACCEPTED:
        value, effects = ACCEPTED[flag]
        args = _parse(tmp_path, _argv(flag, value))
        apply_compat(args)
        for attr, want in effects.items():
            got = getattr(args, attr)
            assert want(got) if callable(want) else got == want, (flag, attr, got)
    else:
        value, words = REFUSED[flag]
        args = _parse(tmp_path, _argv(flag, value))
        with pytest.raises(UsageError) as err:
            apply_compat(args)
        message = str(err.value)
        assert message.startswith(flag) and words in message and "\n" not in message


@pytest.mark.parametrize(("argv", "message"), [
    (["--model_preset", "multimer", "--model_name", "model_2_ptm"], "--model_preset multimer contradicts"),
    (["--model_preset", "monomer", "--model_name", "model_1_multimer_v3"], "--model_preset monomer contradicts"),
    (["--model_preset", "multimer", "--pdb_seqres_database_path", "x"], "hmmsearch template search"),
    (["--preset", "reduced_dbs"], "reduced_dbs"),
    (["--config_preset", "model_3", "--model_name", "model_2"], "--config_preset model_3 contradicts --model_name"),
    (["--skip_relaxation", "--relaxation"], "--skip_relaxation contradicts --relaxation"),
    (["--data_random_seed", "x"], "expected an integer"),
])
def test_contradicting_or_impossible_compat_values_are_one_line(tmp_path, argv, message):
    from lowmem.suite.commands.fold_compat import apply_compat

    with pytest.raises(UsageError, match=message):
        apply_compat(_parse(tmp_path, argv))


def test_openfold_command_line_runs_with_a_folder_of_fasta_files(tmp_path, capsys):
    fastas = tmp_path / "fastas"
    fastas.mkdir()
    (fastas / "a.fasta").write_text("\ufeff>sp|P0CG48|UBC_HUMAN Polyubiquitin-C\nMQIFVKTLTG\n", encoding="utf-8")
    (fastas / "b.fasta").write_text(">pep2 second\nMKTAYIAK\n")
    mmcifs = str(ASSETS / "mmcifs")
    argv = ["fold", str(fastas), mmcifs, "--output_dir", str(tmp_path / "out"), "--config_preset", "model_1_ptm",
            "--skip_relaxation", "--data_random_seed", "3", "--cif_output", "--save_outputs", "--model_device", "cpu",
            "--use_precomputed_alignments", str(tmp_path / "aln"), "--single_sequence", "--num_workers", "0"]
    (tmp_path / "aln" / "P0CG48").mkdir(parents=True)
    (tmp_path / "aln" / "pep2").mkdir(parents=True)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "P0CG48" in out and "pep2" in out
    record = json.loads((tmp_path / "out" / "P0CG48" / "timings.json").read_text())
    assert record["description"] == "sp|P0CG48|UBC_HUMAN Polyubiquitin-C" and record["relax"] is None
    assert (tmp_path / "out" / "pep2" / "pep2_unrelaxed.cif").exists()


# ------------------------------------------------------------------------------------------- bad input


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def param_files(tmp_path_factory):
    import torch

    from lowmem.fastfold.model import AlphaFold, config
    from lowmem.fastfold.params import save_params

    tmp = tmp_path_factory.mktemp("params")
    torch.manual_seed(0)
    good = tmp / "params_model_1_ptm.npz"
    save_params(AlphaFold(config.tiny()), good)
    data = good.read_bytes()
    (tmp / "random.npz").write_bytes(bytes(range(256)) * 64)
    (tmp / "truncated.npz").write_bytes(data[: len(data) // 2])
    (tmp / "params.bin").write_bytes(data)
    with zipfile.ZipFile(tmp / "other.npz", "w") as z:
        z.writestr("weights.npy", b"")
    return tmp


def _alignment_dirs(tmp: Path) -> dict[str, Path]:
    dirs = {}
    for kind, files in {"empty": {}, "unknown": {"notes.txt": b"x", "hits.a3m.zip": b"PK"},
                        "binary": {"uniref90_hits.sto": bytes(range(256))}}.items():
        folder = tmp / kind / "pep"
        folder.mkdir(parents=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        dirs[kind] = folder.parent
    return dirs


BAD = [
    (["--param_path", "{params}/random.npz"], "random.npz: not a readable .npz file"),
    (["--param_path", "{params}/truncated.npz"], "truncated.npz: not a readable .npz file"),
    (["--param_path", "{params}/params.bin"], "params.bin: unknown parameter file type"),
    (["--param_path", "{params}/other.npz"], "other.npz: no AlphaFold parameters"),
    (["--param_path", "{params}/params_model_1_ptm.npz", "--model_name", "model_3"],
     "looks like a model_1 or model_2_ptm file, but --model_name model_3 needs no template, no pTM weights"),
    (["--model_name", ""], "--model_name '': names no model"),
    (["--model_name", " , "], "names no model"),
    (["--seed", "-5"], "--seed must be >= 0, got -5"),
    (["--num_seeds", "0"], "--num_seeds must be >= 1"),
    (["--num_recycle", "-1"], "--num_recycle must be >= 0"),
    (["--ray_address", "127.0.0.1:{port}"], "no answer within 3 s"),
    (["--ray_address", "nonsense"], "expected host:port, ray://host:port or auto"),
    (["--ray_address", "auto"], "--ray_address auto: no running Ray cluster found"),
    (["--use_precomputed_alignments", "{aln}/empty"], "it holds nothing; add --single_sequence"),
    (["--use_precomputed_alignments", "{aln}/unknown"], "it holds only hits.a3m.zip, notes.txt"),
    (["--use_precomputed_alignments", "{aln}/binary", "--single_sequence"], "uniref90_hits.sto: not a text file"),
    (["--use_precomputed_alignments", "{aln}/binary"], "uniref90_hits.sto: not a text file"),
]


@pytest.mark.parametrize(("flags", "message"), BAD, ids=[b[1][:40] for b in BAD])
def test_bad_input_is_one_line_exit_2_before_any_work(tmp_path, param_files, monkeypatch, capsys, flags, message):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no_ray"))
    _alignment_dirs(tmp_path)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMKTAYIAK\n")
    fill = {"params": str(param_files), "port": str(_free_port()), "aln": str(tmp_path)}
    out = tmp_path / "out"
    argv = ["fold", str(fasta), "--output_dir", str(out), "--no-relax", *[f.format(**fill) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1 and "Traceback" not in err
    assert not out.exists()  # before any work


def test_cuda_device_without_cuda_is_refused(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMK\n")
    assert main(["fold", str(fasta), "--output_dir", str(tmp_path / "o"), "--model_device", "cuda:0"]) == 2
    assert "--model_device cuda:0: CUDA is not available here" in capsys.readouterr().err


def test_ray_address_auto_says_which_cluster_it_joins(tmp_path, monkeypatch, caplog):
    from lowmem.suite.commands.fold import _check_ray_address
    from lowmem.utils import ray_cluster

    monkeypatch.setattr(ray_cluster, "check_ray_auth", lambda address, flag: None)  # a plain socket, not a GCS

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        current = tmp_path / "ray" / "ray_current_cluster"
        current.parent.mkdir()
        current.write_text(address + "\n")
        monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
        assert _check_ray_address("auto") == address
        assert f"joining the Ray cluster at {address} (from {current})" in caplog.text
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert _check_ray_address("auto") == address and "(from RAY_ADDRESS)" in caplog.text


_TOKEN_HEAD = r"""
import sys
import ray
ctx = ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1], configure_logging=False)
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture
def token_cluster(tmp_path):
    """A one-CPU Ray head with token authentication (Ray >= 2.52), in its own process group; its GCS address
    and token. HOME points into tmp_path, so no ~/.ray/auth_token of this machine is read or written."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import tempfile

    ray = pytest.importorskip("ray")
    raylet = pytest.importorskip("ray._raylet")
    if not hasattr(raylet, "AuthenticationMode"):
        pytest.skip(f"Ray {ray.__version__} has no token authentication")
    token = "5ee7a1f0" * 4
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit in 107 characters
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "HOME": str(tmp_path)}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([sys.executable, "-c", _TOKEN_HEAD, temp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        address = head.stdout.readline().strip()
        assert address, "the token-auth Ray head did not start"
        yield address, token
    finally:
        try:
            head.stdin.close()
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the group this fixture started
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_address_that_needs_a_token_is_refused_in_one_line(tmp_path, monkeypatch, capsys, token_cluster):
    """Issue 21: a cluster with token authentication and no (or a wrong) token here: one line, exit 2, before any
    work; with the cluster's token the address is accepted."""
    from lowmem.suite.commands.fold import _check_ray_address

    address, token = token_cluster
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMKTAYIAK\n")
    out = tmp_path / "out"
    assert main(["fold", str(fasta), "--output_dir", str(out), "--no-relax", "--ray_address", address]) == 2
    err = capsys.readouterr().err
    assert f"--ray_address {address}: the Ray cluster requires an authentication token" in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1 and "Traceback" not in err
    assert not out.exists()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 32)
    with pytest.raises(UsageError, match="requires an authentication token"):
        _check_ray_address(address)
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    assert _check_ray_address(address) == address
