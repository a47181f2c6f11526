"""Tools for testing kaitian scripts without the hardware (see :mod:`kaitian.testing.fake_accelerator`)."""
