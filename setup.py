"""The one build step pyproject.toml cannot say: the manual's pages (docs/*.md) go into the
package as gputrace/manual/, which `gputrace docs PAGE` prints where there is no checkout."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DOCS = Path(__file__).resolve().parent / "docs"


class BuildWithManual(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):   # it reads docs/ in the checkout
            return
        dst = Path(self.build_lib) / "gputrace" / "manual"
        dst.mkdir(parents=True, exist_ok=True)
        for page in sorted(DOCS.glob("*.md")):
            self.copy_file(str(page), str(dst / page.name))


setup(cmdclass={"build_py": BuildWithManual})
