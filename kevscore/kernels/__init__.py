"""The layer ops of each backend (torch, FLA) and our Triton kernels.

flash-linear-attention's packages are registered first, so that our imports of its kernel modules skip its
package-level imports (`fla_packages`)."""
from kevscore.kernels.fla_packages import defer_package_inits

defer_package_inits()
