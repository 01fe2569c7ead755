"""A format of your own: convolution weights kept in channels_last.

oneDNN's CPU convolution (and cuDNN's tensor-core kernels) prefer NHWC
weights; a model declares NCHW. Registering this format makes
``backend="wformat"`` move each Conv2d weight once into channels_last (the
same Parameter object; its values, shape and state_dict unchanged) and report
it; ``wfpass.restore`` returns it to contiguous. Run it:

    python examples/channels_last_conv.py
"""
import copy

import torch
import torch.nn as nn

import wfpass


class ChannelsLastConv(wfpass.ParamFormat):
    name = "channels_last_conv"
    targets = (torch.conv2d, torch.nn.functional.conv2d, nn.Conv2d)
    roles = ("weight",)

    def check(self, node, tensors):
        if tensors["weight"].dim() != 4:
            return "not a 4-D convolution weight"
        return None

    def to_format(self, t):
        return t.contiguous(memory_format=torch.channels_last)

    def from_format(self, t):
        return t.contiguous()


def main():
    wfpass.register_format(ChannelsLastConv)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3)).eval()
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend="wformat")
        x = torch.randn(2, 3, 16, 16)
        with torch.no_grad():
            for _ in range(3):  # the first call runs eagerly, then one recompile sees the new layout
                out = compiled(x)
            torch.testing.assert_close(out, ref(x), rtol=1e-4, atol=1e-5)
        # Every decision about this model: the move on the first compile,
        # "already in this format" on the recompile it caused.
        print(wfpass.report(model))
        assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in model if isinstance(m, nn.Conv2d))
        assert list(model.state_dict()) == list(ref.state_dict())
        wfpass.restore(model)
        assert all(m.weight.is_contiguous() for m in model if isinstance(m, nn.Conv2d))
        print("channels_last_conv: output equal to eager; restore returned contiguous weights")
    finally:
        wfpass.unregister_format("channels_last_conv")


if __name__ == "__main__":
    main()
