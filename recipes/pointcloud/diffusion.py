"""The diffusion process: the original's linear noise schedule, noising for training, and the
DDPM and DDIM samplers that turn random points into an implant."""

from __future__ import annotations

import torch
from torch import nn

from accel_common import ConfigError
from recipes.pointcloud.model import predict_noise


class Diffusion:
    """Linear beta schedule 1e-4 -> 0.02 over T = 1000 steps (scaled by 1000/T for fewer steps,
    so the last step is as noisy as the original's); epsilon prediction; DDPM and DDIM samplers."""

    def __init__(self, timesteps: int, device: torch.device | str = "cpu") -> None:
        scale = 1000 / timesteps
        betas = torch.linspace(1e-4 * scale, 0.02 * scale, timesteps, dtype=torch.float64)
        self.timesteps = timesteps
        self.betas = betas.clamp(max=0.999).float().to(device)
        self.alphas_cumprod = torch.cumprod(1 - betas.clamp(max=0.999), 0).float().to(device)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t][:, None, None]
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        skull: torch.Tensor,
        num_nn: int,
        steps: int,
        generator: torch.Generator,
        sampler: str = "ddim",
    ) -> torch.Tensor:
        """Implant points for each skull: DDIM (eta 0) over `steps` steps, or full DDPM as the
        original samples (posterior mean and variance, nothing clipped)."""
        shape = (skull.shape[0], num_nn, 3)
        x = torch.randn(shape, generator=generator).to(skull.device)
        if sampler == "ddpm":
            for t in reversed(range(self.timesteps)):
                tt = torch.full((shape[0],), t, device=skull.device, dtype=torch.long)
                eps = predict_noise(model, skull, x, tt)
                # the original's p_sample (model_var_type 'fixedsmall', no clipping): x0 from
                # eps, the posterior mean of q(x_{t-1} | x_t, x0), the posterior variance
                a_bar, beta = self.alphas_cumprod[t], self.betas[t]
                a_prev = self.alphas_cumprod[t - 1] if t else torch.ones_like(a_bar)
                x0 = (1 / a_bar).sqrt() * x - (1 / a_bar - 1).sqrt() * eps
                mean = (beta * a_prev.sqrt() * x0 + (1 - a_prev) * (1 - beta).sqrt() * x) / (
                    1 - a_bar
                )
                variance = beta * (1 - a_prev) / (1 - a_bar)
                if t == 0:  # posterior_log_variance_clipped: t = 0 takes t = 1's (unused: no noise)
                    variance = torch.zeros_like(variance)
                noise = torch.randn(shape, generator=generator).to(skull.device) if t else 0
                x = mean + variance.sqrt() * noise
            return x
        ts = torch.linspace(self.timesteps - 1, 0, steps).round().long().tolist()
        for t, t_next in zip(ts, [*ts[1:], -1], strict=True):
            tt = torch.full((shape[0],), t, device=skull.device, dtype=torch.long)
            eps = predict_noise(model, skull, x, tt)
            a_bar = self.alphas_cumprod[t]
            x0 = ((x - (1 - a_bar).sqrt() * eps) / a_bar.sqrt()).clamp(-4, 4)
            a_next = self.alphas_cumprod[t_next] if t_next >= 0 else torch.ones_like(a_bar)
            x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
        return x


def checked_sampler(name: str) -> str:
    """`name` if it is a sampler of Diffusion.sample, else a one-line error naming --sampler."""
    if name not in ("ddpm", "ddim"):
        raise ConfigError(f"--sampler must be ddpm or ddim, got {name}")
    return name


def checked_sample_steps(steps: int, sampler: str, timesteps: int, given: bool = False) -> int:
    """`steps`, unless DDIM is asked for more steps than the model has timesteps (it would
    repeat timesteps, a network pass each, changing nothing), or a command is `given`
    --sample-steps with DDPM, which takes all T steps whatever the flag says."""
    if given and sampler == "ddpm":
        raise ConfigError(
            f"--sample-steps {steps}: DDPM takes all {timesteps} steps of the model; drop the "
            "flag, or add --sampler ddim"
        )
    if sampler == "ddim" and steps > timesteps:
        raise ConfigError(
            f"--sample-steps {steps} exceeds the model's --timesteps {timesteps}: DDIM takes at "
            f"most one step per timestep; give at most {timesteps}"
        )
    return steps
