"""The bases every settings class derives from, and how ``hotlora serve`` layers them.

``Group``: a frozen pydantic model (the engine's nested groups, ``RequestLimits`` and ``StepCache``).
``Settings``: a pydantic-settings model (``EngineConfig``, ``StoreConfig``, ``ServerConfig``).
Both read operator text through ``fields.from_text`` before pydantic validates, take positional
arguments in field order (as the dataclasses they replaced did), offer ``replace(**changes)`` (the
``dataclasses.replace`` they had, validated) and turn pydantic's ``ValidationError`` into one
``SettingsError`` that names each setting.

Built in code (``EngineConfig(target_rank=8)``), a settings object holds its arguments over its
defaults and reads nothing else: a library user's engine does not change with the environment.
``Settings.layered`` is what ``hotlora serve`` reads, with pydantic-settings' own sources in the
README's order: keyword arguments (the flags) > ``HOTLORA_<FIELD>`` variables
(``EnvSettingsSource``) > the config file's table (``TomlConfigSettingsSource`` /
``YamlConfigSettingsSource``, or a table already read) > the defaults.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

from hotlora.settings.fields import (
    ENV_PREFIX,
    SettingsError,
    bare,
    default_of,
    from_text,
    spelled,
)
from hotlora.settings.files import read_config_file


class _Layering(NamedTuple):
    cls: type  # the class being layered (objects it builds inside, like its EngineConfig, are not)
    files: tuple  # functions settings_cls -> a pydantic-settings source, highest priority first


# Set only while ``Settings.layered`` builds its object: sources are chosen per instantiation.
_LAYERING: ContextVar[_Layering | None] = ContextVar("hotlora_settings_layering", default=None)


def _field_path(cls, loc) -> tuple[str, object]:
    """The dotted setting name of an error's location and the innermost field's ``FieldInfo``."""
    names, model, info = [], cls, None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            break
        info = fields[part]
        names.append(part)
        model = bare(info.annotation)
    return ".".join(names), info


def explain(cls, exc: ValidationError) -> str:
    """One line per setting pydantic refused, in words an operator can act on."""
    said: dict[str, str] = {}
    for error in exc.errors():
        name, info = _field_path(cls, error["loc"])
        if error["type"] == "extra_forbidden":
            where = ".".join(map(str, error["loc"]))
            said[where] = f"unknown setting {where!r} for {cls.__name__}; known: {', '.join(cls.model_fields)}"
        elif error["type"] in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
            said.setdefault(name, (f"{name}: " if name else "") + str(error["ctx"]["error"]))
        elif info is not None:
            said.setdefault(name, f"{name} must be {spelled(info.annotation)}, got {error['input']!r} "
                                  f"({error['msg']})")
        else:
            said.setdefault(name, f"{name or cls.__name__}: {error['msg']}")
    return "; ".join(said.values())


class Group(BaseModel):
    """A frozen group of settings nested in another (``EngineConfig.limits``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, *args, **values):
        names = list(type(self).model_fields)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        values.update(zip(names, args))
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(explain(type(self), exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _read_text(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: from_text(fields[k], v) if k in fields else v for k, v in data.items()}

    def replace(self, **changes):
        """A copy with ``changes``, validated as a new object is (``dataclasses.replace``'s role)."""
        if not changes:
            return self
        return type(self)(**{**{n: getattr(self, n) for n in type(self).model_fields}, **changes})

    __replace__ = replace  # copy.replace (Python 3.13)

    @classmethod
    def default(cls, name: str):
        """A field's default (pydantic keeps defaults off the class: ``StoreConfig.x`` is no value)."""
        return default_of(cls.model_fields[name])


class Settings(Group, BaseSettings):
    """A pydantic-settings model: ``HOTLORA_<FIELD>`` variables, a config file's table and keyword
    arguments, layered by ``layered``; built directly, only its arguments count."""

    # enable_decoding=False: a variable holding a list is the comma-separated text operators type,
    # not JSON; ``from_text`` reads it.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=False, enable_decoding=False)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        layering = _LAYERING.get()
        if layering is None or layering.cls is not settings_cls:
            return (init_settings,)  # built in code: its arguments over its defaults, nothing read from outside
        return (init_settings, env_settings, *(source(settings_cls) for source in layering.files))

    @classmethod
    def layered(cls, config_file: str | Path | None = None, table: str | None = None, file_values=None,
                **flags):
        """``flags`` (None: not given) > ``HOTLORA_*`` > the ``[table]`` of ``config_file`` (TOML, or
        YAML of the same shape) > ``file_values`` (a table already read) > defaults."""
        files = []
        if config_file is not None and table in read_config_file(config_file):
            if str(config_file).endswith((".yaml", ".yml")):
                files.append(lambda c: YamlConfigSettingsSource(c, yaml_file=config_file, yaml_config_section=table))
            else:
                files.append(lambda c: TomlConfigSettingsSource(c, toml_file=config_file, toml_table_header=(table,)))
        if file_values:
            files.append(lambda c: InitSettingsSource(c, init_kwargs=dict(file_values)))
        token = _LAYERING.set(_Layering(cls, tuple(files)))
        try:
            return cls(**{k: v for k, v in flags.items() if v is not None})
        finally:
            _LAYERING.reset(token)
