"""The contract every family keeps, run on each entry of ``kit.KITS`` (one test class a family,
so a shuffled run still starts one server per family):

* ``vqserve import`` through the CLI writes a directory the family claims, and says what it
  imported in its one line; any import given a file that is no checkpoint, or a checkpoint
  another family declares (``ForeignMark`` in its ``declare.py``), refuses in one line,
  writes nothing, and names the right import where the table knows it;
* one real gRPC server (127.0.0.1, port 0) gives the reference's tokens and pixels over v1
  (sync and async clients), OIP, and the `vqserve encode` / `decode` CLI clients;
* one `vqserve tokenize` output is read back by ``TokenShards``, re-encoded by `verify`,
  decoded by `detokenize` into the reference's pixels, and `eval` runs on the same images;
* every export format the kit names keeps the reference's tokens, the search (the kit's
  ``island_ops``) in the island.

What only one family has stays in its ``test_<family>.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import assert_matches_reference, tokenize_grids, write_case_photos
from tests.integration.families.kit import (
    KITS,
    FamilyKit,
    export_keeps_the_tokens,
    oip_encode,
)
from vqserve.cli import main as cli_main
from vqserve.model.families import family_for
from vqserve.model.families.table import import_specs

pytestmark = pytest.mark.timeout(900)  # hang guards: servers and CLI clients on a loaded 2-core box


@pytest.mark.parametrize("spec", import_specs(), ids=lambda spec: spec.command)
def test_a_file_that_is_no_checkpoint_is_refused_in_one_line(spec, tmp_path, capsys):
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"this is not a checkpoint\n")
    assert cli_main(["import", spec.command, str(junk), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vqserve import: error:") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="class")
def kit(request) -> FamilyKit:
    return request.cls.kit


@pytest.fixture(scope="class")
def cases(kit):
    return kit.cases()


@pytest.fixture(scope="class")
def release(kit, tmp_path_factory) -> str:
    return kit.release(tmp_path_factory.mktemp(f"{kit.command}-release"))


@pytest.fixture(scope="class")
def imported(kit, release, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(f"{kit.command}-imported") / "model"
    with kit.registered():
        assert cli_main(["import", kit.command, release, *kit.options, "--out", str(out), "--quiet"]) == 0
    return str(out)


@pytest.fixture(scope="class")
def server(imported):
    """One server a family, for v1, OIP and every client."""
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    cfg = ServerConfig(model=imported, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=0, max_batch_size=4, max_delay_ms=5, grace_s=5)
    # start() waits for the model and the start-up certification (a hang guard, not a time limit)
    with ServerThread(cfg).start(timeout=600) as running:
        yield running


@pytest.fixture(scope="class")
def photos(kit, cases, tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp(f"{kit.command}-photos") / "photos"
    return folder, write_case_photos(cases, kit.case_names, folder, "{case}_indices")


@pytest.fixture(scope="class")
def tokens(kit, imported, photos, tmp_path_factory) -> tuple[Path, dict]:
    """One `vqserve tokenize` output a family."""
    out = tmp_path_factory.mktemp(f"{kit.command}-tokens") / "tokens"
    return out, tokenize_grids(imported, photos[0], out, *kit.tokenize)


class FamilyContract:
    kit: FamilyKit

    def decoded1(self, cases) -> dict[str, np.ndarray]:
        return {f"{case}{i}": image for case in self.kit.case_names
                for i, image in enumerate(cases[f"{case}_{self.kit.decoded1}"].numpy())}

    # ---- import -------------------------------------------------------------------------------
    def test_cli_import_writes_a_directory_the_family_claims(self, release, imported, tmp_path, capsys):
        assert family_for(imported).name == self.kit.family
        with self.kit.registered():
            assert cli_main(["import", self.kit.command, release, *self.kit.options, "--out",
                             str(tmp_path / "again")]) == 0
            err = capsys.readouterr().err
            assert err.startswith(self.kit.summary) and f"serve it:  vqserve serve --model {tmp_path / 'again'}" in err
            assert cli_main(["import", self.kit.command, release, *self.kit.options, "--out",
                             str(tmp_path / "again")]) == 2
        assert "already exists" in capsys.readouterr().err

    def test_other_imports_refuse_this_checkpoint_in_one_line(self, release, tmp_path, capsys):
        """Each other import of the kit, given this family's release, refuses in one line and
        writes nothing; where this family declares tensors as its mark, the line names its import."""
        from vqserve.model.families.table import foreign_marks

        marked = any(mark.command == self.kit.command and mark.tensors for mark in foreign_marks())
        for other in KITS:
            if other.command == self.kit.command:
                continue
            out = tmp_path / other.command
            assert cli_main(["import", other.command, release, *other.options, "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and not out.exists(), (other.command, err)
            if marked and other.command == "taming":  # the import that reads the table's marks
                weights = Path(release)
                if weights.is_dir():  # a released folder (TiTok): the mark is on its weights file
                    weights = next(p for p in sorted(weights.iterdir()) if p.suffix in (".safetensors", ".bin"))
                    assert cli_main(["import", other.command, str(weights), *other.options, "--out", str(out)]) == 2
                    err = capsys.readouterr().err
                assert f"`vqserve import {self.kit.command}`" in err and not out.exists(), err

    # ---- one server: v1 (sync + async clients), OIP, the CLI clients ---------------------------
    def test_served_v1_oip_and_clients_give_the_reference(self, server, cases, photos, tmp_path):
        from vqserve.serve.clients.sync import TokenizerClient

        with TokenizerClient(server.target, timeout=120) as client:
            info = client.model_info()
            assert {k: info[k] for k in self.kit.info} == self.kit.info and info["exact"]
            for case in self.kit.case_names:
                indices = client.encode(cases[f"{case}_images"].numpy())
                reference = cases[f"{case}_indices"].numpy().astype(indices.dtype)
                assert_matches_reference(indices, reference, "indices")
                assert_matches_reference(client.decode(reference), cases[f"{case}_{self.kit.decoded1}"].numpy(),
                                         "pixels")
                assert_matches_reference(oip_encode(server.target, cases[f"{case}_images"].numpy()), reference,
                                         "OIP indices")
        last = self.kit.case_names[-1]
        got = asyncio.run(self._async_encode(server.target, cases[f"{last}_images"].numpy()))
        assert_matches_reference(got, cases[f"{last}_indices"].numpy().astype(got.dtype), "async client indices")
        folder, expected = photos
        assert cli_main(["encode", str(folder), "--server", server.target, "--out", str(tmp_path / "npy"),
                         "--no-progress"]) == 0
        for key, grid in expected.items():
            assert_matches_reference(np.load(tmp_path / "npy" / f"{key}.npy").astype(np.int64), grid, "encode CLI")
        assert cli_main(["decode", str(tmp_path / "npy"), "--server", server.target, "--out", str(tmp_path / "png"),
                         "--no-progress"]) == 0
        for key, image in self.decoded1(cases).items():
            assert_matches_reference(np.asarray(Image.open(tmp_path / "png" / f"{key}.png")), image, "decode CLI")

    @staticmethod
    async def _async_encode(target: str, images: np.ndarray) -> np.ndarray:
        from vqserve.serve.clients import AsyncTokenizerClient

        async with AsyncTokenizerClient(target, timeout=120) as client:
            return await client.encode(images)

    # ---- one tokenize output: TokenShards, verify, detokenize; eval -----------------------------
    def test_tokenize_shards_verify_detokenize_and_eval(self, imported, cases, photos, tokens, tmp_path):
        from vqserve.offline.token_shards import TokenShards

        folder, expected = photos
        out, grids = tokens
        assert len(grids) == len(expected)
        for key, grid in grids.items():
            assert_matches_reference(grid, np.asarray(expected[Path(key).stem]).astype(grid.dtype), "tokenized grid")
        rows = {Path(row["key"]).stem: row["tokens"].numpy() for row in TokenShards(out)}
        assert {k: v.tolist() for k, v in rows.items()} == {k: np.asarray(v).tolist() for k, v in expected.items()}
        assert cli_main(["verify", str(out), "--sample", str(len(expected))]) == 0
        assert cli_main(["detokenize", str(out), "--out", str(tmp_path / "recon"), "--no-progress"]) == 0
        decoded1 = self.decoded1(cases)
        pngs = list((tmp_path / "recon").rglob("*.png"))
        assert len(pngs) == len(expected)
        for png in pngs:
            assert_matches_reference(np.asarray(Image.open(png)), decoded1[png.stem], "detokenized")
        assert cli_main(["eval", "--model", imported, "--images", str(folder), "--precisions", "bf16",
                         "--tile", "0", "--no-learnability", "--json"]) == 0

    # ---- exports -------------------------------------------------------------------------------
    def test_exports_keep_the_reference_tokens(self, fmt, imported, cases, tmp_path):
        export_keeps_the_tokens(imported, fmt, tmp_path, cases, self.kit.case_names, self.kit.island_ops)


def pytest_generate_tests(metafunc):
    """``fmt``: each export format of the class's kit (all but torchscript marked slow)."""
    if "fmt" in metafunc.fixturenames:
        metafunc.parametrize("fmt", [pytest.param(fmt, marks=pytest.mark.slow) if fmt != "torchscript" else fmt
                                     for fmt in metafunc.cls.kit.exports])


# one test class per kit entry (kit.KITS is the list; nothing to add here for a new family)
for _kit in KITS:
    globals()[f"Test{_kit.command.title()}"] = type(f"Test{_kit.command.title()}", (FamilyContract,), {"kit": _kit})
del _kit
