"""How ONE model replica is split over ranks.

The outer axes (pipeline, CFG) apply to every domain. Inside one pipeline/CFG
partition, the dense, attention and MoE domains each split the same pool of
`domain_ranks` ranks their own way, so their products must agree:

    dense.tp * dense.dp == attention.tp * attention.cp * attention.dp == moe.tp * moe.ep * moe.dp

A domain the user leaves unset is inferred as data-parallel over the whole
partition: `ParallelConfig(dense=DenseParallelConfig(tp_size=2))` gives
attention dp=2 and moe dp=2. Replica count is NOT here (see DeploymentConfig).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field, model_validator

from phyai_ray.config.base import ConfigModel
from phyai_ray.errors import ParallelConfigError

DOMAINS = ("dense", "attention", "moe")
Degree = Field(default=1, ge=1, le=4096)


class OuterParallelConfig(ConfigModel):
    """Axes that apply to every domain: pipeline stages and classifier-free-guidance branches."""

    pp_size: int = Field(1, ge=1, le=4096, description="Pipeline stages; blocks are split into this many stages.")
    cfg_size: int = Field(1, ge=1, le=2, description="CFG branches run on separate ranks (1 or 2).")


class DenseParallelConfig(ConfigModel):
    """Split of the dense (MLP / projection) layers inside one partition."""

    tp_size: int = Field(1, ge=1, le=4096, description="Tensor-parallel degree of dense layers.")
    dp_size: int = Field(1, ge=1, le=4096, description="Data-parallel degree of dense layers.")

    def ranks(self) -> int:
        return self.tp_size * self.dp_size


class AttentionParallelConfig(ConfigModel):
    """Split of attention inside one partition: heads (tp), sequence (cp), batch (dp)."""

    tp_size: int = Field(1, ge=1, le=4096, description="Attention heads split over this many ranks.")
    cp_size: int = Field(1, ge=1, le=4096, description="Context parallel: the sequence split over this many ranks.")
    dp_size: int = Field(1, ge=1, le=4096, description="Data-parallel degree of attention (batch split).")

    def ranks(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size


class MoeParallelConfig(ConfigModel):
    """Split of mixture-of-experts layers inside one partition."""

    tp_size: int = Field(1, ge=1, le=4096, description="Each expert's weights split over this many ranks.")
    ep_size: int = Field(1, ge=1, le=4096, description="Experts split over this many ranks.")
    dp_size: int = Field(1, ge=1, le=4096, description="Data-parallel degree of the MoE layers.")

    def ranks(self) -> int:
        return self.tp_size * self.ep_size * self.dp_size


_DOMAIN_TYPES = {"dense": DenseParallelConfig, "attention": AttentionParallelConfig, "moe": MoeParallelConfig}


class ParallelConfig(ConfigModel):
    """The topology of one replica. Read topology only from here, never from RANK/WORLD_SIZE.

    Example: `ParallelConfig(outer=OuterParallelConfig(pp_size=2), dense=DenseParallelConfig(tp_size=2),
    attention=AttentionParallelConfig(tp_size=2))` is 4 ranks per replica (MoE inferred as dp=2).
    """

    outer: OuterParallelConfig = Field(default_factory=OuterParallelConfig,
                                       description="Pipeline and CFG degrees, applied to every domain.")
    dense: DenseParallelConfig | None = Field(None, description="Dense-layer split; unset means dp over the partition.")
    attention: AttentionParallelConfig | None = Field(
        None, description="Attention split; unset means dp over the partition.")
    moe: MoeParallelConfig | None = Field(None, description="MoE split; unset means dp over the partition.")

    domain_names: ClassVar[tuple[str, ...]] = DOMAINS

    @model_validator(mode="after")
    def _infer_and_check(self) -> "ParallelConfig":
        given = {d: getattr(self, d) for d in DOMAINS if getattr(self, d) is not None}
        products = {d: cfg.ranks() for d, cfg in given.items()}
        if len(set(products.values())) > 1:
            shown = ", ".join(f"{d}={_formula(d, given[d])}" for d in given)
            raise ParallelConfigError(
                "every domain must cover the same number of ranks inside one pipeline/CFG partition, "
                f"got {shown}; make the products equal, or leave a domain unset so it is inferred as "
                "data-parallel (e.g. ParallelConfig(dense=DenseParallelConfig(tp_size=2), "
                "attention=AttentionParallelConfig(tp_size=2)))")
        size = next(iter(products.values()), 1)
        for d in DOMAINS:
            if d not in given:
                object.__setattr__(self, d, _DOMAIN_TYPES[d](dp_size=size))
                self.__pydantic_fields_set__.discard(d)  # `dense=None` is unset too: inferred, not explicit
        return self

    @property
    def explicit_domains(self) -> frozenset[str]:
        """The domains the user set; the others were inferred as pure data parallel."""
        return frozenset(DOMAINS) & self.model_fields_set

    @property
    def domain_ranks(self) -> int:
        """Ranks inside one pipeline/CFG partition (the common domain product)."""
        return self.dense.ranks()

    def infer_replica_world_size(self) -> int:
        """Ranks of one replica: `pp * cfg * domain_ranks`."""
        return self.outer.pp_size * self.outer.cfg_size * self.domain_ranks

    def split_axes(self) -> dict[str, int]:
        """Axes that split work and are > 1 (`pp`, `cfg`, `dense_tp`, ...); inferred dp is left out."""
        axes = {"pp": self.outer.pp_size, "cfg": self.outer.cfg_size}
        for d in DOMAINS:
            for name, size in getattr(self, d).model_dump().items():
                if name != "dp_size" or d in self.explicit_domains:
                    axes[f"{d}_{name[:-5]}"] = size
        return {k: v for k, v in axes.items() if v > 1}

    def describe(self) -> str:
        """One line for logs: `pp=2 cfg=1 dense(tp=2,dp=1) attention(tp=2,cp=1,dp=1) moe(...)`."""
        parts = [f"pp={self.outer.pp_size}", f"cfg={self.outer.cfg_size}"]
        for d in DOMAINS:
            sizes = ",".join(f"{k[:-5]}={v}" for k, v in getattr(self, d).model_dump().items())
            parts.append(f"{d}({sizes})")
        return " ".join(parts) + f" -> {self.infer_replica_world_size()} ranks"


def _formula(domain: str, cfg: BaseModel) -> str:
    sizes = cfg.model_dump()
    return "*".join(str(v) for v in sizes.values()) + f"={cfg.ranks()} ({'*'.join(k[:-5] for k in sizes)})"
