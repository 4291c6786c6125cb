"""Generate the man pages and the shell completions from their sources, so none can drift:

    python tools/debian/gen_docs.py OUT_DIR   ->  OUT_DIR/agentzip-blk.1, agentzip-blk.yaml.5,
                                                  agentzip-blk.bash, _agentzip-blk (zsh),
                                                  agentzip-blk.fish

agentzip-blk(1) and the completions come from the CLI parser itself
(``agentzip_blk.cli.build_parser``): argparse-manpage writes the page, shtab the bash and zsh
completion (the ``package`` extra of pyproject.toml), and ``fish_completion`` below the fish one
(shtab has no fish). agentzip-blk.yaml(5) comes from ``agentzip_blk.config.reference``, the
source of the shipped conffile too. tools/build-deb.sh runs this at package build time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import shtab
from argparse_manpage.manpage import Manpage

from agentzip_blk import __version__
from agentzip_blk.cli import PROG, build_parser
from agentzip_blk.config import reference

SEE_ALSO = """\
[see also]
.BR swapon (8),
.BR zramctl (8),
.BR nbdkit (1),
.BR nbdkit-python-plugin (3),
.BR systemd.resource-control (5),
.BR agentzip-blk.yaml (5)

.PP
The README (/usr/share/doc/agentzip-blk/README.md): setup, configuration, operation.

[files]
.TP
.I /etc/agentzip/config.yaml
The configuration (every key optional):
.BR agentzip-blk.yaml (5).
.TP
.I /run/agentzip
The run directory: state file, sockets, logs of the attached device.
.TP
.I /usr/lib/systemd/system/agentzip-blk.service
Attaches the device at boot (before swap.target); agentzip-blk-health.timer runs
.B agentzip-blk status
every 30 s and leaves agentzip-blk-health.service failed when the server is not healthy.

[exit status]
0 success; 1 a runtime failure (a tool failed, swapoff refused); 2 bad input or setup
(one line "agentzip-blk: error: ..."); status: 3 nothing attached, 4 attached but not healthy.
"""


def manpage() -> str:
    # the date of the source, not of the build: reproducible (SOURCE_DATE_EPOCH if set)
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))
    include = Path(os.environ.get("TMPDIR", "/tmp")) / f"agentzip-man-{os.getpid()}.txt"
    include.write_text(SEE_ALSO)
    try:
        page = Manpage(build_parser(), _data={
            "project_name": PROG, "version": __version__, "manual_section": 1,
            "manual_title": "agentzip-blk manual",
            "date": time.strftime("%Y-%m-%d", time.gmtime(epoch)),
            "description": "compressed, deduplicating userspace swap device for agent sandboxes",
            "include": str(include),
        }, format="single-commands-section")
        return str(page)
    finally:
        include.unlink()


def _date() -> str:
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))
    return time.strftime("%Y-%m-%d", time.gmtime(epoch))


def roff(text: str) -> str:
    """Plain text for a roff line: backslashes and hyphens escaped, no leading control dot."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


CONFIG_PAGE_HEAD = """\
.SH DESCRIPTION
agentzip\\-blk reads
.I /etc/agentzip/config.yaml
(or the file given with
.BR \\-\\-config ),
then every
.I *.yaml
file of the
.I config.d/
directory beside it, in name order; names starting with a dot are ignored. A drop-in is
merged over what came before: mappings key by key, any other value (a scalar, the
.B scopes
list) replaced whole. Every key is optional; the defaults below apply. Unknown keys, wrong
types and impossible values are errors that name the file and the key: nothing starts on a
bad config.
.B agentzip\\-blk config show
prints the merged config and, for each value, the file that set it.
.PP
The package's
.I /etc/agentzip/config.yaml
has every setting commented out at its default: uncommenting a line changes nothing.
The tools never write it:
.B agentzip\\-blk scope
and the node agent write
.IR config.d/90\\-scopes.yaml .
.SH SIZES AND DURATIONS
Sizes take util\\-linux's suffixes (what
.BR zramctl (8)
and
.BR swapon (8)
take):
.BR K ", " M ", " G ", " T ", " P ", " E
alone or as
.BR KiB ", " MiB ", " GiB ...
are powers of 1024
.RB ( 8G
is 8 GiB);
.BR KB ", " MB ", " GB ...
are powers of 1000
.RB ( 8GB
is 8,000,000,000 bytes); either case; a plain number is bytes. Durations take
.BR ms ", " s ", " m ", " h ", " d
.RB ( 30s ", " 500ms );
a plain number is seconds.
"""

CONFIG_PAGE_TAIL = """\
.SH FILES
.TP
.I /etc/agentzip/config.yaml
The configuration (a conffile of the package).
.TP
.I /etc/agentzip/config.d/*.yaml
Drop\\-ins, merged in name order;
.I 90\\-scopes.yaml
is the tools'.
.TP
.I /run/agentzip/config.yaml
The config the running server was started with, written by
.BR "agentzip\\-blk up" .
.SH EXAMPLE
.EX
pool:
  max_size: 2G
  swap_out_path: /var/lib/agentzip/swapfile
device:
  size: 16G
scopes:
  \\- cgroup: agent\\-sandbox\\-*.slice
.EE
.SH SEE ALSO
.BR agentzip\\-blk (1),
.BR swapon (8),
.BR zramctl (8)
"""


def config_manpage() -> str:
    """agentzip-blk.yaml(5): every key of ``config.reference`` with its default."""
    out = [f'.TH AGENTZIP\\-BLK.YAML 5 "{_date()}" "{PROG} {__version__}" "agentzip-blk manual"',
           ".SH NAME", "agentzip\\-blk.yaml \\- configuration of the agentzip\\-blk swap device",
           ".SH SYNOPSIS", ".I /etc/agentzip/config.yaml", ".br", ".I /etc/agentzip/config.d/*.yaml",
           CONFIG_PAGE_HEAD.rstrip("\n")]
    defaults = reference.defaults()
    for section in reference.sections():
        out += [".SH " + section.upper()]
        for k in reference.keys_of(section):
            if k.name == "scopes":
                default = ", ".join(f"{{cgroup: {s['cgroup']}, enabled: "
                                    f"{str(s['enabled']).lower()}}}" for s in defaults["scopes"])
                default = f"[{default}]"
            else:
                default = reference.value_text(k.name, reference.default_of(k.name, defaults))
            out += [".TP", f".BR {roff(k.name.split('.')[-1])} \" (default {roff(default)})\"",
                    f"Takes {roff(k.takes)}. {roff(k.text)}"]
    out.append(CONFIG_PAGE_TAIL.rstrip("\n"))
    return "\n".join(out) + "\n"


def completion(shell: str = "bash") -> str:
    return shtab.complete(build_parser(), shell=shell)


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _first_line(text: str | None) -> str:
    text = " ".join((text or "").split())
    return text.split(". ")[0].rstrip(".")[:80]


def fish_completion() -> str:
    """fish's completion, from the parser: subcommands (and their own subcommands) with their
    help, each one's options, the global options everywhere."""
    parser = build_parser()
    lines = [f"# fish completion for {PROG}, generated from its parser (tools/debian/gen_docs.py)",
             f"complete -c {PROG} -f"]

    def options(p: argparse.ArgumentParser, cond: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction) or a.help == argparse.SUPPRESS:
                continue
            longs = [o[2:] for o in a.option_strings if o.startswith("--")]
            shorts = [o[1:] for o in a.option_strings if len(o) == 2 and o[0] == "-"]
            if not longs and not shorts:
                continue
            parts = [f"complete -c {PROG}"] + ([f"-n {_fish_quote(cond)}"] if cond else [])
            parts += [f"-l {x}" for x in longs] + [f"-s {x}" for x in shorts]
            if a.nargs != 0:
                parts.append("-r")
                if a.choices:
                    parts.append(f"-a {_fish_quote(' '.join(map(str, a.choices)))}")
                elif (a.metavar or "") in ("PATH", "FILE", "DIR") or "path" in (a.dest or ""):
                    parts.append("-F")
            if a.help:
                parts.append(f"-d {_fish_quote(_first_line(a.help))}")
            lines.append(" ".join(parts))

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if path:
            options(p, "__fish_seen_subcommand_from " + path[-1])
        if sub is None:
            return
        helps = {c.dest: c.help for c in sub._choices_actions}
        names = list(sub.choices)
        if path:
            cond = f"__fish_seen_subcommand_from {path[-1]}; and not __fish_seen_subcommand_from {' '.join(names)}"
        else:
            cond = "__fish_use_subcommand"
        for name in names:
            lines.append(f"complete -c {PROG} -n {_fish_quote(cond)} -a {name} "
                         f"-d {_fish_quote(_first_line(helps.get(name)))}")
        for name, child in sub.choices.items():
            walk(child, path + [name])

    options(parser, "")
    walk(parser, [])
    return "\n".join(lines) + "\n"


def main(out: str) -> int:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{PROG}.1").write_text(manpage())
    (d / f"{PROG}.yaml.5").write_text(config_manpage())
    (d / f"{PROG}.bash").write_text(completion("bash"))
    (d / f"_{PROG}").write_text(completion("zsh"))
    (d / f"{PROG}.fish").write_text(fish_completion())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
