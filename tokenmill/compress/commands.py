"""The compression commands behind `tokenmill quantize | prune | distill | qat`: check every input
first, do the work, write the result through `export.atomic_output_dir`, load it back once to
prove it serves, and return a JSON-able report (also saved as compression.json)."""
from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

from tokenmill.compress import calib, export
from tokenmill.models import loader
from tokenmill.utils import default_model_path, resolve_device


def _load_float(path: str | None, device: str = "cpu") -> loader.LoadedModel:
    loaded = loader.load(path or default_model_path(), "float32", resolve_device(device), quantization="none")
    export.check_exportable(loaded.arch)
    return loaded


def _tokens(loaded: loader.LoadedModel, path: str) -> list[int]:
    if loaded.tokenizer is None:
        raise ValueError("the model has no tokenizer; calibration text cannot be tokenized.")
    return loaded.tokenizer.encode(calib.read_text(path), add_special_tokens=False)


def _calibration(tokenizer, paths: list[str], num_samples: int, seq_len: int) -> list[torch.Tensor]:
    if tokenizer is None:
        raise ValueError("the model has no tokenizer; calibration text cannot be tokenized.")
    return calib.mixed_windows([calib.source_tokens(tokenizer, p) for p in paths], num_samples, seq_len)


def _calib_report(paths: list[str], num_samples: int, seq_len: int) -> dict:
    return {"files": [os.path.abspath(p) for p in paths], "samples": num_samples, "seq_len": seq_len}


def _source_report(loaded: loader.LoadedModel, path: str | None) -> dict:
    return {"source": os.path.abspath(path or default_model_path()),
            "source_parameters": export.count_parameters(loaded.model)}


def _verify(out_dir: str) -> None:
    """Load the written checkpoint back and run it: a model that cannot be served is not an output."""
    from tokenmill.resources import return_freed_memory

    return_freed_memory()  # what the compression freed goes back to the system first
    back = loader.load(out_dir, "float32", torch.device("cpu"))
    ids = torch.arange(min(8, back.arch.vocab_size))
    logits = back.model.compute_logits(back.model(ids, torch.arange(ids.numel())))
    if not torch.isfinite(logits).all():
        raise ValueError("the compressed model produces non-finite logits; nothing was written.")


def run_quantize(args: argparse.Namespace) -> dict:
    """Streams the source a decoder layer at a time (compress/stream.py): memory is one layer in
    float32 plus the calibration's activations plus the packed output, at any model size."""
    from tokenmill.compress import gguf_export
    from tokenmill.compress import quantize as q
    from tokenmill.compress.stream import LayerStream, calibration_bytes

    to_gguf = getattr(args, "output_format", "safetensors") == "gguf"
    source = args.model or default_model_path()
    cfg = q.QuantizeConfig(args.method, args.group_size, args.calib_samples, args.calib_seq_len, args.act_order,
                           args.damp, args.allow_partial_groups, args.compute_dtype, args.hessian_shrink,
                           args.awq_clip)
    if to_gguf:
        export.check_output_file(args.output, args.overwrite)
        gguf_export.check_source(source)
    else:
        export.check_output_dir(args.output, args.overwrite)
    calib_paths = calib.required_sources(args.calib, "--calib", f"for {cfg.method}") if cfg.calibrated else None
    stream = LayerStream(source)
    cfg.validate(stream.model)
    stream.check_fits(calibration_bytes(stream.arch, cfg.calib_samples, cfg.calib_seq_len) if cfg.calibrated else 0)
    t0 = time.perf_counter()
    samples = _calibration(stream.tokenizer, calib_paths, cfg.calib_samples, cfg.calib_seq_len) \
        if cfg.calibrated else None
    report = {"command": "quantize", "method": cfg.method, "group_size": cfg.group_size if cfg.bits == 4 else -1,
              "bits": cfg.bits, "act_order": cfg.uses_act_order,
              "hessian_shrink": cfg.shrink if cfg.method == "gptq" else None,
              "awq_clip": cfg.awq_clip if cfg.method == "awq" else None,
              "source": os.path.abspath(source), "source_parameters": stream.parameters(),
              "calibration": _calib_report(calib_paths, cfg.calib_samples, cfg.calib_seq_len) if samples else None}
    model = stream.model
    if to_gguf:
        sink = gguf_export.GGUFBlocks(model)
        q.quantize_model(model, cfg, samples, progress=not args.quiet, stream=stream, on_layer=sink.add)
    else:
        packed: dict[str, torch.Tensor] = {}
        quantized: set[str] = set()

        def keep(found: dict) -> None:
            packed.update(q.checkpoint_tensors(model, found, cfg))
            quantized.update(found)

        q.quantize_model(model, cfg, samples, progress=not args.quiet, stream=stream, on_layer=keep)
    layers = stream.arch.num_layers
    report["elapsed_s"] = round(time.perf_counter() - t0, 1)
    report.update(seconds_per_layer=round(report["elapsed_s"] / layers, 2), parameters=report["source_parameters"],
                  compute_dtype=str(calib.compute_dtype(cfg.compute_dtype)).replace("torch.", "") if samples else None)
    if to_gguf:
        with export.atomic_output_file(args.output, args.overwrite) as tmp:
            sink.write(tmp, source, model, cfg.method)
            sink = model = stream = None  # noqa: F841 - freed before the verifying load
            report.update(output_format="gguf", peak_rss_gb=_peak_rss_gb())
            _verify(tmp)
        return report
    stream.load_head()
    tensors = export.float_tensors(model, skip=quantized)
    tensors.update(packed)
    packed.clear()
    with export.atomic_output_dir(args.output, args.overwrite) as tmp:
        export.write_checkpoint(tmp, stream.arch, stream.tokenizer, tensors, args.dtype,
                                cfg.hf_quantization_config(), report)
        tensors = model = stream = None  # noqa: F841 - freed before the verifying load
        report["peak_rss_gb"] = _peak_rss_gb()
        _verify(tmp)
    return report


def _peak_rss_gb() -> float:
    """This process's peak resident memory so far: VmHWM (ru_maxrss would carry a parent's peak
    across exec); ru_maxrss where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            return round(next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2 ** 20, 2)
    except (OSError, StopIteration):
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)


def run_prune(args: argparse.Namespace) -> dict:
    from tokenmill.compress import prune

    export.check_output_dir(args.output, args.overwrite)
    sparsity = prune.validate(args.method, args.sparsity)
    calib_paths = calib.required_sources(args.calib, "--calib", f"for {args.method} pruning") \
        if prune.needs_calibration(args.method) else None
    loaded = _load_float(args.model)
    t0 = time.perf_counter()
    samples = _calibration(loaded.tokenizer, calib_paths, args.calib_samples, args.calib_seq_len) \
        if prune.needs_calibration(args.method) else None
    report = {"command": "prune", "method": args.method, "sparsity": sparsity, **_source_report(loaded, args.model)}
    if args.method in prune.STRUCTURED:
        arch, tensors, info = prune.prune_structured(loaded.model, args.method, sparsity, samples)
    else:
        info = prune.prune_unstructured(loaded.model, args.method, sparsity, samples)
        arch, tensors = loaded.arch, export.float_tensors(loaded.model)
    report.update(info, elapsed_s=round(time.perf_counter() - t0, 1))
    report["parameters"] = sum(t.numel() for t in tensors.values())
    report["parameter_reduction"] = round(1 - report["parameters"] / report["source_parameters"], 4)
    with export.atomic_output_dir(args.output, args.overwrite) as tmp:
        export.write_checkpoint(tmp, arch, loaded.tokenizer, tensors, args.dtype, None, report)
        _verify(tmp)
    return report


def _distill_config(args: argparse.Namespace):
    from tokenmill.compress import distill

    cfg = distill.DistillConfig(args.steps, args.batch_size, args.seq_len, args.lr, args.warmup_steps,
                                args.temperature, args.hidden_loss_weight, args.eval_every, args.eval_tokens,
                                args.save_every, args.seed)
    cfg.validate()
    data = calib.required(args.data, "--data", f"to {args.cmd} on")
    if args.eval_data:
        calib.read_text(args.eval_data)
    return cfg, data


def _training_text(loaded: loader.LoadedModel, args: argparse.Namespace, data: str, cfg) -> tuple[list, list | None]:
    eval_ids = _tokens(loaded, args.eval_data)[: cfg.eval_tokens] if args.eval_data else None
    return _tokens(loaded, data), eval_ids


def _work_dir(args: argparse.Namespace) -> str:
    return args.checkpoint_dir or os.path.abspath(args.output).rstrip("/") + ".ckpt"


def run_distill(args: argparse.Namespace) -> dict:
    from tokenmill.compress import distill

    export.check_output_dir(args.output, args.overwrite)
    cfg, data = _distill_config(args)
    teacher = _load_float(args.teacher)
    student = _load_float(args.student)
    train_ids, eval_ids = _training_text(student, args, data, cfg)
    work_dir = _work_dir(args)
    t0 = time.perf_counter()
    history = distill.distill(teacher.model, student.model, train_ids, eval_ids, cfg, work_dir,
                              progress=not args.quiet)
    report = {"command": "distill", "teacher": os.path.abspath(args.teacher or default_model_path()),
              "student": os.path.abspath(args.student), "data": os.path.abspath(data),
              "eval_data": os.path.abspath(args.eval_data) if args.eval_data else None,
              "config": cfg.__dict__, "elapsed_s": round(time.perf_counter() - t0, 1), "history": history}
    tensors = export.float_tensors(student.model)
    report["parameters"] = sum(t.numel() for t in tensors.values())
    with export.atomic_output_dir(args.output, args.overwrite) as tmp:
        export.write_checkpoint(tmp, student.arch, student.tokenizer, tensors, args.dtype, None, report)
        _verify(tmp)
    shutil.rmtree(work_dir, ignore_errors=True)  # the run is complete: its resume state has served
    return report


def run_qat(args: argparse.Namespace) -> dict:
    """PTQ start (or the one saved by an interrupted run) -> fake-quant training -> the checkpoint."""
    from tokenmill.compress import distill, qat
    from tokenmill.compress import quantize as q

    export.check_output_dir(args.output, args.overwrite)
    group = args.group_size if args.group_size is not None else (-1 if args.bits == 8 else 128)
    qcfg = qat.QATConfig(args.bits, group, args.init, args.allow_partial_groups, args.act_order,
                         args.calib_samples, args.calib_seq_len, args.scale_lr)
    cfg, data = _distill_config(args)
    calibrated = qcfg.quantize_config().calibrated
    calib_paths = calib.required_sources(args.calib or [data], "--calib", f"for --init {qcfg.init}") \
        if calibrated else None
    student = _load_float(args.model)
    qcfg.validate(student.model)
    teacher = _load_float(args.teacher or args.model)
    distill.check_pair(teacher.model, student.model, cfg.hidden_loss_weight)
    train_ids, eval_ids = _training_text(student, args, data, cfg)
    work_dir = _work_dir(args)
    t0 = time.perf_counter()
    results = qat.load_start(work_dir, qcfg, student.model)
    if results is None:
        samples = _calibration(student.tokenizer, calib_paths, qcfg.calib_samples, qcfg.calib_seq_len) \
            if calibrated else None
        results = q.quantize_model(student.model, qcfg.quantize_config(), samples, progress=not args.quiet)
        qat.latent_start(student.model, results)
        qat.save_start(work_dir, qcfg, student.model, results)
    init_s = time.perf_counter() - t0
    qat.attach(student.model, results)
    history = qat.train(teacher.model, student.model, train_ids, eval_ids, cfg, qcfg.scale_lr, work_dir,
                        progress=not args.quiet)
    results = qat.finish(student.model)
    report = {"command": "qat", "method": f"qat-{qcfg.init}", "bits": qcfg.bits, "group_size": qcfg.group_size,
              **_source_report(student, args.model),
              "teacher": os.path.abspath(args.teacher or args.model or default_model_path()),
              "data": os.path.abspath(data), "calibration": [os.path.abspath(p) for p in calib_paths] if calib_paths else None,
              "eval_data": os.path.abspath(args.eval_data) if args.eval_data else None,
              "qat": qcfg.__dict__, "config": cfg.__dict__, "init_s": round(init_s, 1),
              "elapsed_s": round(time.perf_counter() - t0, 1), "history": history}
    report["parameters"] = report["source_parameters"]
    tensors = export.float_tensors(student.model, skip=set(results))
    tensors.update(q.checkpoint_tensors(student.model, results, qcfg.quantize_config()))
    with export.atomic_output_dir(args.output, args.overwrite) as tmp:
        export.write_checkpoint(tmp, student.arch, student.tokenizer, tensors, args.dtype,
                                qcfg.quantization_config(), report)
        _verify(tmp)
    shutil.rmtree(work_dir, ignore_errors=True)
    return report
