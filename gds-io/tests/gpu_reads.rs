//! GPU checks (opt-in): every I/O path's bytes in device memory equal the file's bytes.
//!
//! Run with `GDSLLM_GPU_TESTS=1`; without it each test prints that it skipped. With it, a
//! machine without a working GPU FAILS. `GDSLLM_GPU_TEST_DIR` picks where the test file is
//! written (default: the system temp dir; use a disk-backed directory so O_DIRECT and cuFile
//! work), `GDSLLM_GPU_TEST_MIB` its size in MiB (default 256; the file gets an unaligned tail).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use gds_io::{
    BounceConfig, BounceReader, CufileConfig, CufileReader, DeviceIo, DeviceRead, DeviceReader,
    Driver, GdsBuffer, GdsError, GdsFile, Gpu, HostStagedConfig, HostStagedReader, IoChoice,
    IoPath, UdevCheck, UdevStatus,
};

fn gpu_or_skip(test: &str) -> Option<Gpu> {
    if std::env::var("GDSLLM_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("{test}: skipped (set GDSLLM_GPU_TESTS=1 to run GPU tests)");
        return None;
    }
    match Gpu::open(0) {
        Ok(gpu) => Some(gpu),
        Err(err) => panic!("GDSLLM_GPU_TESTS=1 but no GPU works: {err}"),
    }
}

struct TestFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
    bytes: Vec<u8>,
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn test_file(tail: usize) -> TestFile {
    let base = std::env::var_os("GDSLLM_GPU_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let mib: usize = std::env::var("GDSLLM_GPU_TEST_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let dir = tempfile::tempdir_in(&base).expect("cannot create test dir");
    let len = (mib << 20) + tail;
    let mut state = 0x1234_5678_9abc_def1u64 ^ len as u64;
    let mut bytes = vec![0u8; len];
    for chunk in bytes.chunks_mut(8) {
        let word = xorshift(&mut state).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    let path = dir.path().join("weights.bin");
    let mut out = std::fs::File::create(&path).unwrap();
    out.write_all(&bytes).unwrap();
    out.sync_all().unwrap();
    eprintln!("test file {} of {} bytes", path.display(), len);
    TestFile {
        _dir: dir,
        path,
        bytes,
    }
}

/// Reads the whole file, then random regions (aligned starts, any length) at random aligned
/// destination offsets, and compares the device bytes with the file's.
fn check_reader(reader: &dyn DeviceReader, gpu: &Gpu, file: &GdsFile, bytes: &[u8]) {
    let kind = reader.kind();
    let buffer = GdsBuffer::alloc(gpu, bytes.len() + (1 << 20)).unwrap();
    let record = reader
        .read(&DeviceRead::from_start(file, bytes.len(), &buffer))
        .unwrap();
    assert_eq!(record.bytes, bytes.len() as u64);
    assert_eq!(record.io_path, kind.name());
    let back = buffer.copy_to_host(0..bytes.len()).unwrap();
    let first_diff = back.iter().zip(bytes).position(|(a, b)| a != b);
    assert_eq!(
        first_diff, None,
        "{kind}: whole-file read differs at byte {first_diff:?}"
    );
    eprintln!(
        "{kind}: whole file {} bytes in {} requests, {:.2} GB/s, via host memory: {}",
        record.bytes,
        record.requests,
        record.gbps(),
        record.via_host_memory
    );

    let mut state = 42u64;
    let pages = bytes.len() / 4096;
    for round in 0..24 {
        let start_page = (xorshift(&mut state) as usize) % pages;
        let offset = start_page * 4096;
        let max_len = bytes.len() - offset;
        let len = match round % 3 {
            0 => (xorshift(&mut state) as usize % max_len.min(64 << 20)).max(1),
            1 => (xorshift(&mut state) as usize % 4096).max(1).min(max_len),
            _ => max_len, // runs to the unaligned end of the file
        };
        let dst_offset = (xorshift(&mut state) as usize % 256) * 4096;
        reader
            .read(&DeviceRead {
                offset: offset as u64,
                dst_offset,
                ..DeviceRead::from_start(file, len, &buffer)
            })
            .unwrap();
        let back = buffer.copy_to_host(dst_offset..dst_offset + len).unwrap();
        assert!(
            back == bytes[offset..offset + len],
            "{kind}: region {offset}+{len} (dst {dst_offset}) differs"
        );
    }
    let totals = reader.stats();
    assert_eq!(totals.reads, 25);
}

#[test]
fn bounce_reads_equal_file_bytes() {
    let Some(gpu) = gpu_or_skip("bounce_reads_equal_file_bytes") else {
        return;
    };
    let tf = test_file(1234);
    let file = GdsFile::open(&tf.path).unwrap();
    // Small slots so that even small reads split across the ring and threads.
    let small = BounceReader::new(
        &gpu,
        BounceConfig {
            slot_bytes: 1 << 20,
            slots: 5,
            threads: 3,
        },
    )
    .unwrap();
    check_reader(&small, &gpu, &file, &tf.bytes);
    let default = BounceReader::new(&gpu, BounceConfig::default()).unwrap();
    check_reader(&default, &gpu, &file, &tf.bytes);
}

#[test]
fn host_staged_reads_equal_file_bytes() {
    let Some(gpu) = gpu_or_skip("host_staged_reads_equal_file_bytes") else {
        return;
    };
    let tf = test_file(4095);
    let file = GdsFile::open(&tf.path).unwrap();
    let reader = HostStagedReader::new(
        &gpu,
        HostStagedConfig {
            window_bytes: 3 << 20,
            ..Default::default()
        },
    );
    check_reader(&reader, &gpu, &file, &tf.bytes);
}

#[test]
fn cufile_reads_equal_file_bytes_or_registration_is_explained() {
    let Some(gpu) = gpu_or_skip("cufile_reads_equal_file_bytes_or_registration_is_explained")
    else {
        return;
    };
    let driver =
        Driver::open().expect("libcufile must load and its driver open on the GPU machine");
    eprintln!("cuFile properties: {:?}", driver.properties());
    let tf = test_file(1);
    let mut file = GdsFile::open(&tf.path).unwrap();
    match file.register(&driver) {
        Ok(()) => {}
        Err(err @ GdsError::Register { .. }) => {
            let udev = UdevCheck::for_path(&tf.path).unwrap();
            eprintln!("registration failed: {err}");
            assert_ne!(
                udev.status,
                UdevStatus::Ok,
                "registration failed although the udev record is fine: {err}"
            );
            assert!(
                err.to_string().contains("ID_FS_USAGE") || udev.status == UdevStatus::NoBlockDevice
            );
            return;
        }
        Err(other) => panic!("unexpected registration error: {other}"),
    }
    assert!(file.is_registered());
    let reader = CufileReader::new(
        &gpu,
        &driver,
        CufileConfig {
            request_bytes: 3 << 20,
            threads: 6,
        },
    );
    check_reader(&reader, &gpu, &file, &tf.bytes);
    // A registered destination buffer, too; registration is undone on drop.
    let mut registered = GdsBuffer::alloc(&gpu, tf.bytes.len()).unwrap();
    registered.register(&driver).unwrap();
    assert!(registered.is_registered());
    reader
        .read(&DeviceRead::from_start(&file, tf.bytes.len(), &registered))
        .unwrap();
    assert!(registered.copy_to_host(0..tf.bytes.len()).unwrap() == tf.bytes);
    let live = driver.live_registrations();
    eprintln!("registrations in force: {live:?}");
    assert!(live.file_handles >= 1 && live.buffers >= 1, "{live:?}");
    drop(registered);
    drop(file);
    drop(reader);
    // Every registration made above was undone on drop, none twice.
    let live = driver.live_registrations();
    eprintln!("registrations after drop: {live:?}");
    assert_eq!(
        (live.file_handles, live.buffers),
        (0, 0),
        "unbalanced: {live:?}"
    );
}

#[test]
fn async_bounce_read_is_ordered_on_the_stream() {
    let Some(gpu) = gpu_or_skip("async_bounce_read_is_ordered_on_the_stream") else {
        return;
    };
    let tf = test_file(777);
    let file = GdsFile::open(&tf.path).unwrap();
    let reader = BounceReader::new(&gpu, BounceConfig::default()).unwrap();
    let stream: Arc<_> = gpu.new_stream().unwrap();
    let buffer = GdsBuffer::alloc(&gpu, tf.bytes.len()).unwrap();
    let ticket = reader
        .read_async(
            &DeviceRead::from_start(&file, tf.bytes.len(), &buffer),
            &stream,
        )
        .unwrap();
    let record = ticket.wait().unwrap();
    assert_eq!(record.bytes, tf.bytes.len() as u64);
    assert!(buffer.copy_to_host(0..tf.bytes.len()).unwrap() == tf.bytes);
}

#[test]
fn device_io_auto_choice_reads_correctly() {
    let Some(_gpu) = gpu_or_skip("device_io_auto_choice_reads_correctly") else {
        return;
    };
    let tf = test_file(100);
    for choice in [
        IoChoice::Auto,
        IoChoice::Force(IoPath::Cufile),
        IoChoice::Force(IoPath::Bounce),
        IoChoice::Force(IoPath::Host),
    ] {
        let mut io = DeviceIo::open(0, choice).unwrap();
        let file = io.open_file(&tf.path).unwrap();
        eprintln!(
            "{choice:?}: I/O path {} (capabilities {:?})",
            io.kind(),
            io.capabilities()
        );
        let buffer = io.alloc(tf.bytes.len()).unwrap();
        io.read(&DeviceRead::from_start(&file, tf.bytes.len(), &buffer))
            .unwrap();
        assert!(
            buffer.copy_to_host(0..tf.bytes.len()).unwrap() == tf.bytes,
            "{choice:?}"
        );
    }
}

/// Residency's streaming pattern: chunk i+1 is queued before chunk i is waited for, into two
/// alternating buffers; every chunk must land whole, with the queue shared across chunks.
#[test]
fn bounce_pipeline_double_buffered_reads_equal_file_bytes() {
    let Some(gpu) = gpu_or_skip("bounce_pipeline_double_buffered_reads_equal_file_bytes") else {
        return;
    };
    let tf = test_file(5000);
    let file = GdsFile::open(&tf.path).unwrap();
    let chunk = 24 << 20;
    let buffers = [
        GdsBuffer::alloc(&gpu, chunk).unwrap(),
        GdsBuffer::alloc(&gpu, chunk).unwrap(),
    ];
    for mib in [1usize, 4, 16] {
        let bounce = BounceReader::new(&gpu, BounceConfig::with_request(mib << 20, 8)).unwrap();
        let chunks: Vec<(usize, usize)> = (0..tf.bytes.len())
            .step_by(chunk)
            .map(|start| (start, chunk.min(tf.bytes.len() - start)))
            .collect();
        let checked = bounce
            .pipeline(|p| {
                let mut pending = std::collections::VecDeque::new();
                let mut checked = 0usize;
                let mut finish = |ticket, index: usize| -> Result<(), GdsError> {
                    p.wait(ticket)?;
                    let (start, len) = chunks[index];
                    let back = buffers[index % 2].copy_to_host(0..len)?;
                    assert!(
                        back == tf.bytes[start..start + len],
                        "{mib} MiB requests: chunk {index} at {start} differs"
                    );
                    checked += 1;
                    Ok(())
                };
                for (index, &(start, len)) in chunks.iter().enumerate() {
                    if pending.len() == 2 {
                        let (ticket, i) = pending.pop_front().unwrap();
                        finish(ticket, i)?;
                    }
                    let ticket = p.submit(DeviceRead {
                        offset: start as u64,
                        ..DeviceRead::from_start(&file, len, &buffers[index % 2])
                    })?;
                    pending.push_back((ticket, index));
                }
                for (ticket, i) in pending {
                    finish(ticket, i)?;
                }
                Ok(checked)
            })
            .unwrap();
        assert_eq!(checked, chunks.len());
        eprintln!("bounce pipeline, {mib} MiB requests: {checked} chunks equal the file");
    }
}

/// read_many queues every request of several reads at once (bounce and, when the file
/// registers, cufile); each destination must hold its own region.
#[test]
fn read_many_fills_every_destination() {
    let Some(gpu) = gpu_or_skip("read_many_fills_every_destination") else {
        return;
    };
    let tf = test_file(321);
    let file = GdsFile::open(&tf.path).unwrap();
    let regions = [
        (0usize, 5 << 20),
        (8 << 20, 33 << 20),
        (tf.bytes.len() - 4000, 4000),
    ];
    let buffers: Vec<GdsBuffer> = regions
        .iter()
        .map(|&(_, len)| GdsBuffer::alloc(&gpu, len).unwrap())
        .collect();
    let reads: Vec<DeviceRead<'_>> = regions
        .iter()
        .zip(&buffers)
        .map(|(&(offset, len), dst)| DeviceRead {
            file: &file,
            offset: offset as u64 & !4095,
            len,
            dst,
            dst_offset: 0,
        })
        .collect();
    let bounce = BounceReader::new(&gpu, BounceConfig::default()).unwrap();
    let records = bounce.read_many(&reads).unwrap();
    assert_eq!(records.len(), reads.len());
    for (read, buffer) in reads.iter().zip(&buffers) {
        let start = read.offset as usize;
        assert!(
            buffer.copy_to_host(0..read.len).unwrap() == tf.bytes[start..start + read.len],
            "bounce read_many region at {start}"
        );
    }
}

/// `visit_on_host` shows every byte of a range once, in order, equal to `copy_to_host`'s, for
/// ranges shorter than, equal to and longer than a piece, and unaligned ones.
#[test]
fn visit_on_host_shows_the_device_bytes_in_order() {
    let Some(gpu) = gpu_or_skip("visit_on_host_shows_the_device_bytes_in_order") else {
        return;
    };
    let len = (9 << 20) + 1234;
    let mut state = 7u64;
    let bytes: Vec<u8> = (0..len).map(|_| xorshift(&mut state) as u8).collect();
    let buffer = GdsBuffer::alloc(&gpu, len).unwrap();
    buffer.copy_from_host(0, &bytes).unwrap();
    let mut staging = gds_io::HostStaging::alloc(&gpu, 1 << 20).unwrap();
    assert_eq!(staging.piece_bytes(), 1 << 20);
    for range in [
        0..len,
        0..(1 << 20),
        4097..(3 << 20) + 5,
        len - 10..len,
        5..5,
    ] {
        let mut seen = Vec::with_capacity(range.len());
        let mut pieces = 0;
        buffer
            .visit_on_host(range.clone(), &mut staging, |piece| {
                pieces += 1;
                seen.extend_from_slice(piece);
            })
            .unwrap();
        assert!(seen == bytes[range.clone()], "range {range:?} differs");
        assert_eq!(pieces, range.len().div_ceil(1 << 20), "range {range:?}");
        eprintln!("visit_on_host {range:?}: {pieces} pieces, bytes equal");
    }
    let err = buffer
        .visit_on_host(len - 1..len + 1, &mut staging, |_| {})
        .unwrap_err();
    assert!(matches!(err, GdsError::RangeOutsideBuffer { .. }), "{err}");
}
