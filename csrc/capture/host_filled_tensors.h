// Composite kernels that fill a fresh tensor through its data pointer.
//
// A few CompositeImplicitAutograd ops build a small tensor on the host and write its elements
// directly: F.ctc_loss's mean reduction turns `target_lengths` into a tensor with at::tensor()
// (at::empty, then std::copy into data_ptr), and its Tensor overload and nn.utils.rnn's
// pad_packed_sequence read lengths through const_data_ptr (aten/src/ATen/native/LossCTC.cpp,
// PackedSequence.cpp). Inside a region the at::empty would be an op of the program, and in
// co-execution a placeholder without memory: the kernel raised "its data is not allocated yet".
//
// For these ops a kernel on AutogradPrivateUse3 (ahead of the composite one) gives the tensor
// arguments the kernel reads on the host their values, then runs the composite kernel with host
// factories turned real: a factory it calls makes an ordinary tensor, unrecorded, which later ops
// read as an input from outside, exactly as if torch.tensor() had made it (HostFactories). Every
// other op inside is intercepted as usual.
//
// The same slot holds `_has_compatible_shallow_copy_type`, which torch's set_data
// (`p.data = tensor`) asks before it gives `p` the tensor's storage: a placeholder gets its value
// first and becomes an ordinary tensor, and both become inputs from outside once the graph has
// run what was posted before (Region::note_data_replaced).
//
// Example: F.ctc_loss(lp, targets, [12, 12], [4, 3]) in co-execution records
//     _ctc_loss(lp, targets, [12, 12], [4, 3])   (the lists are scalars the graph is fed)
//     clamp_min(<external: tensor([4, 3])>, 1)   (at::tensor's empty() is not recorded)
//     div(...), mean(...)
#pragma once

namespace terra::capture {

// While true on this thread, factories (ops without tensor arguments) run for real and are not
// intercepted (capture/interceptor.cpp, factory_kernel).
bool host_factories_on_this_thread();

}  // namespace terra::capture
