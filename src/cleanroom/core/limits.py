"""An episode's resource limits: as asked (``Limits``, any field unset) and as an environment
is created with (``ResolvedLimits``, every field set)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    """Resource limits of one episode. Unset fields fall back to the baseline's defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float | None = Field(default=None, gt=0, le=24 * 3600)
    vcpus: int | None = Field(default=None, ge=1, le=64)
    memory_mib: int | None = Field(default=None, ge=64, le=256 * 1024)
    output_quota_mib: int | None = Field(default=None, ge=1, le=64 * 1024)

    def merged_over(self, defaults: Limits) -> ResolvedLimits:
        """These limits with every unset field taken from ``defaults`` (then built-ins)."""
        base = ResolvedLimits()
        return ResolvedLimits(
            timeout_s=self.timeout_s or defaults.timeout_s or base.timeout_s,
            vcpus=self.vcpus or defaults.vcpus or base.vcpus,
            memory_mib=self.memory_mib or defaults.memory_mib or base.memory_mib,
            output_quota_mib=(
                self.output_quota_mib or defaults.output_quota_mib or base.output_quota_mib
            ),
        )


class ResolvedLimits(BaseModel):
    """Limits with every field set: what an environment is actually created with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = 60.0
    vcpus: int = 1
    memory_mib: int = 256
    output_quota_mib: int = 64
