"""Stage 2, denoise: the Bayesian denoiser (g_out, dg_out, log_z_out) over the generated kernels."""
