"""The argparse conventions of every `meshtron` command.

One-line usage errors with a "did you mean" (difflib), no prefix abbreviations, every long flag in
both kebab-case and snake_case, booleans as `--x` / `--no-x` (`--x true|false` also accepted), and a
short `--help` that lists the config sections of a command (`--help-all` lists every field).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any, Optional

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

TRUE_WORDS = ("true", "yes", "1", "on")
FALSE_WORDS = ("false", "no", "0", "off")


def spellings(option: str) -> list[str]:
    """A long flag and its kebab-case and snake_case spellings: --a.b_c -> --a.b_c, --a.b-c."""
    if not option.startswith("--"):
        return [option]
    body = option[2:]
    return list(dict.fromkeys([option, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")]))


def canonical(option: str) -> str:
    """The spelling flags are compared in: snake_case (`--max-new-tokens` -> `--max_new_tokens`)."""
    return "--" + option[2:].replace("-", "_") if option.startswith("--") else option


def negative(option: str) -> str:
    """The false flag of a boolean, in the flag's own style: --enforce-eager -> --no-enforce-eager,
    --section.field_name -> --section.no_field_name (config flags are snake_case, like YAML keys)."""
    head, dot, name = option[2:].rpartition(".")
    return f"--{head}{dot}no{'_' if dot else '-'}{name}"


def parse_bool(text: str, option: str) -> bool:
    if text.lower() in TRUE_WORDS:
        return True
    if text.lower() in FALSE_WORDS:
        return False
    raise argparse.ArgumentError(None, f"{option}: expected true or false, got {text!r}")


class BoolFlag(argparse.Action):
    """A boolean: `--x` sets true, `--no-x` false; `--x true|false` is accepted as well. With
    `as_text` the value is stored as 'true'/'false' (config overrides are text, like YAML)."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, help: Optional[str] = None,
                 as_text: bool = False, **kwargs: Any):
        kwargs.pop("type", None)
        kwargs.pop("nargs", None)
        self.positives = list(option_strings)
        self.negatives = [negative(o) for o in option_strings if o.startswith("--")]
        self.as_text = as_text
        super().__init__([*self.positives, *self.negatives], dest, nargs="?", default=default, help=help,
                         metavar="true|false", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if canonical(option_string) in map(canonical, self.negatives):
            if values is not None:
                parser.error(f"{option_string} takes no value; write {self.positives[0]} {values} instead")
            value = False
        else:
            try:
                value = True if values is None else parse_bool(values, option_string)
            except argparse.ArgumentError as e:
                parser.error(e.message)
        setattr(namespace, self.dest, ("true" if value else "false") if self.as_text else value)


class _HelpAll(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help(full=True), sys.stdout)
        parser.exit()


class Formatter(argparse.HelpFormatter):
    """One spelling per flag in the help (the other spellings parse too); booleans as `--x, --no-x`."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, BoolFlag):
            return ", ".join([*action.positives, *action.negatives])
        return super()._format_action_invocation(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse with meshtron's conventions: a usage error is one line (exit status 2) naming the
    command's help, an unknown flag gets a "did you mean", no abbreviations, kebab and snake spellings."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self.config_groups: list[argparse._ArgumentGroup] = []  # --section.field groups, listed by --help-all
        self.config_summary: list[tuple[str, list[str]]] = []  # (section, its field names) for --help
        self.config_command: Optional[str] = None  # the command whose sections these are (e.g. "train")

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        for action in self._actions:  # every long flag in both spellings (help shows the declared one)
            for option in action.option_strings:
                for alias in spellings(option):
                    self._option_string_actions.setdefault(alias, action)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_message(extras))
        return namespace, extras

    def unknown_message(self, extras: list[str]) -> str:
        """The one line for arguments this parser does not take: the foreign section, or the nearest flag."""
        from meshtron.config.loader import commands_using

        given = f"unrecognized arguments: {' '.join(extras)}"
        flag = next((x.split("=", 1)[0] for x in extras if x.startswith("--")), None)
        if flag is None:
            return given
        section = flag[2:].split(".", 1)[0] if "." in flag else None
        if self.config_command and section and section not in {s for s, _ in self.config_summary}:
            users = commands_using(section)
            if users:
                return (f"{flag}: meshtron {self.config_command} does not use the {section} section; "
                        f"{' and '.join('meshtron ' + c for c in users)} reads it")
        options = {canonical(o): o for a in self._actions if a.help != argparse.SUPPRESS for o in a.option_strings}
        close = difflib.get_close_matches(canonical(flag), list(options), n=1, cutoff=0.75)
        return f"{given}; did you mean {options[close[0]]}?" if close else given

    def foreign_sections(self) -> str:
        """The line naming the sections this command refuses and the commands that read them."""
        from meshtron.config.loader import COMMAND_SECTIONS, commands_using

        if self.config_command is None:
            return ""
        own = {s for s, _ in self.config_summary}
        others = [s for sections in COMMAND_SECTIONS.values() for s in sections if s not in own]
        users = {s: " and ".join(f"meshtron {c}" for c in commands_using(s)) for s in dict.fromkeys(others)}
        by_user: dict[str, list[str]] = {}
        for section, user in users.items():
            by_user.setdefault(user, []).append(section)
        listed = "; ".join(f"{', '.join(sections)} ({user})" for user, sections in by_user.items())
        return f"Not read by meshtron {self.config_command} (refused here): {listed}." if listed else ""

    def add_help_all(self) -> None:
        if not any(isinstance(a, _HelpAll) for a in self._actions):
            self.add_argument("--help-all", action=_HelpAll,
                              help="show every config field with its type, default and help, and exit")

    def format_usage(self) -> str:
        formatter = self._get_formatter()
        formatter.add_usage(self._short_usage(), self._actions, self._mutually_exclusive_groups)
        return formatter.format_help()

    def _short_usage(self) -> Optional[str]:
        """The declared usage; else argparse's when it fits in three lines; else the required flags,
        `[options]` and the positionals."""
        if self.usage is not None:
            return self.usage
        formatter = self._get_formatter()
        formatter.add_usage(None, self._actions, self._mutually_exclusive_groups)
        if formatter.format_help().count("\n") <= 3:
            return None
        parts = ["%(prog)s"]
        for a in self._actions:
            if a.option_strings and a.required:
                parts.append(f"{a.option_strings[-1]} {formatter._format_args(a, a.dest.upper())}")
        if self.config_summary:
            parts.append("[--config C] [--SECTION.FIELD VALUE ...]")
        parts.append("[options]")
        for a in self._actions:
            if not a.option_strings and a.help != argparse.SUPPRESS:
                parts.append(a.metavar or ("COMMAND ..." if isinstance(a, argparse._SubParsersAction) else a.dest))
        return " ".join(parts)

    def format_help(self, full: bool = False) -> str:  # type: ignore[override]
        """The command's own flags and its config sections with their field names; `full`: every field."""
        formatter = self._get_formatter()
        formatter.add_usage(self._short_usage(), self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        for group in self._action_groups:
            if group in self.config_groups and not full:
                continue
            formatter.start_section(group.title)
            formatter.add_text(group.description)
            formatter.add_arguments(group._group_actions)
            formatter.end_section()
        if self.config_summary and not full:
            formatter.start_section("config sections (--help-all: every field's type, default and help)")
            formatter.add_text("Each field is a flag --SECTION.FIELD VALUE (kebab-case or snake_case; a boolean is "
                               "--SECTION.FIELD or --SECTION.no_FIELD) and a key of the --config YAML file.")
            for name, fields in self.config_summary:
                formatter.add_text(f"{name}: {', '.join(fields)}")
            formatter.add_text(self.foreign_sections())
            formatter.end_section()
        formatter.add_text(self.epilog)
        return formatter.format_help()
