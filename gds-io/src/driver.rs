//! The process-wide cuFile driver and the platform facts that decide which path reads take.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use cufile_sys::CuFileApi;

use crate::error::{GdsError, check};

/// What the platform offers GPUDirect Storage, from `cuFileDriverGetProperties` and /proc, /sys.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DriverProperties {
    /// The libcufile file that was loaded.
    pub library: String,
    /// libcufile's version number (e.g. 1150), when it reports one.
    pub library_version: Option<i32>,
    /// The nvidia-fs kernel module is loaded (needed for true GDS DMA on most systems).
    pub nvidia_fs: bool,
    /// nvidia-fs version as reported by the driver, (0, 0) when absent.
    pub nvfs_version: (u32, u32),
    /// NVMe reads can use PCI P2PDMA (the upstream-kernel alternative to nvidia-fs).
    pub p2pdma: bool,
    /// cuFile is in compatibility mode: reads go through host bounce buffers (POSIX reads).
    pub compat_mode: bool,
    /// Largest single direct I/O cuFile issues, in bytes.
    pub max_direct_io_size: usize,
}

impl DriverProperties {
    /// True NVMe→GPU DMA is available (not compatibility mode).
    pub fn gds_dma(&self) -> bool {
        !self.compat_mode
    }
}

/// The opened cuFile driver. One per process: [`Driver::open`] returns the live one if any, and
/// the driver is closed when the last `Arc<Driver>` (held by files and buffers) goes away.
#[derive(Debug)]
pub struct Driver {
    api: &'static CuFileApi,
    properties: DriverProperties,
    live_file_handles: std::sync::atomic::AtomicIsize,
    live_buffers: std::sync::atomic::AtomicIsize,
}

/// How many cuFile registrations made through a [`Driver`] are still in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveRegistrations {
    pub file_handles: isize,
    pub buffers: isize,
}

static CURRENT: Mutex<Weak<Driver>> = Mutex::new(Weak::new());

impl Driver {
    /// Registrations still in force: every successful cuFileHandleRegister / cuFileBufRegister
    /// counts up, its deregistration down; both are 0 once every `GdsFile` and registered
    /// `GdsBuffer` is dropped.
    pub fn live_registrations(&self) -> LiveRegistrations {
        use std::sync::atomic::Ordering::SeqCst;
        LiveRegistrations {
            file_handles: self.live_file_handles.load(SeqCst),
            buffers: self.live_buffers.load(SeqCst),
        }
    }

    pub(crate) fn count_file_handle(&self, delta: isize) {
        self.live_file_handles
            .fetch_add(delta, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn count_buffer(&self, delta: isize) {
        self.live_buffers
            .fetch_add(delta, std::sync::atomic::Ordering::SeqCst);
    }

    /// Loads libcufile (if needed) and opens the driver, or returns the already open one.
    pub fn open() -> Result<Arc<Driver>, GdsError> {
        let mut current = CURRENT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(driver) = current.upgrade() {
            return Ok(driver);
        }
        let api = cufile_sys::api()?;
        // SAFETY: no preconditions; libcufile reference-counts opens.
        let status = unsafe { (api.driver_open)() };
        check("cuFileDriverOpen", status)?;
        let properties = query_properties(api);
        tracing::debug!(?properties, "cuFile driver opened");
        let driver = Arc::new(Driver {
            api,
            properties,
            live_file_handles: Default::default(),
            live_buffers: Default::default(),
        });
        *current = Arc::downgrade(&driver);
        Ok(driver)
    }

    pub fn api(&self) -> &'static CuFileApi {
        self.api
    }

    pub fn properties(&self) -> &DriverProperties {
        &self.properties
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: balances the open in `Driver::open`; every file handle and buffer holds an
        // Arc<Driver>, so none is still registered here.
        let status = unsafe { (self.api.driver_close)() };
        if let Err(err) = check("cuFileDriverClose", status) {
            tracing::warn!("{err}");
        }
    }
}

fn query_properties(api: &CuFileApi) -> DriverProperties {
    let mut props = cufile_sys::CUfileDrvProps_t::default();
    // SAFETY: writes one properties struct through a valid pointer.
    let status = unsafe { (api.driver_get_properties)(&mut props) };
    let props_ok = status.err == cufile_sys::CU_FILE_SUCCESS;
    let nvfs_version = if props_ok {
        (props.nvfs.major_version, props.nvfs.minor_version)
    } else {
        (0, 0)
    };
    let nvidia_fs = nvidia_fs_loaded() || nvfs_version != (0, 0);
    let p2p_flag =
        props_ok && props.nvfs.dstatusflags & (1 << cufile_sys::CU_FILE_NVME_P2P_SUPPORTED) != 0;
    let use_p2p_param = bool_parameter(api, cufile_sys::CUFILE_PARAM_USE_PCIP2PDMA);
    let p2pdma = p2p_flag || (use_p2p_param == Some(true) && pci_p2pdma_present());
    let forced_compat = bool_parameter(api, cufile_sys::CUFILE_PARAM_FORCE_COMPAT_MODE);
    DriverProperties {
        library: api.library.clone(),
        library_version: api.version(),
        nvidia_fs,
        nvfs_version,
        p2pdma,
        compat_mode: forced_compat == Some(true) || !(nvidia_fs || p2pdma),
        max_direct_io_size: if props_ok {
            props.nvfs.max_direct_io_size
        } else {
            0
        },
    }
}

fn bool_parameter(api: &CuFileApi, param: cufile_sys::CUFileBoolConfigParameter_t) -> Option<bool> {
    let get = api.get_parameter_bool?;
    let mut value = false;
    // SAFETY: writes one bool through a valid pointer.
    let status = unsafe { get(param, &mut value) };
    (status.err == cufile_sys::CU_FILE_SUCCESS).then_some(value)
}

/// The nvidia-fs kernel module is loaded.
pub fn nvidia_fs_loaded() -> bool {
    Path::new("/sys/module/nvidia_fs").exists()
        || std::fs::read_to_string("/proc/modules")
            .map(|modules| modules.lines().any(|l| l.starts_with("nvidia_fs ")))
            .unwrap_or(false)
}

/// Some PCI device exposes P2PDMA memory (`/sys/bus/pci/devices/*/p2pmem`).
pub fn pci_p2pdma_present() -> bool {
    std::fs::read_dir("/sys/bus/pci/devices")
        .map(|entries| {
            entries
                .flatten()
                .any(|entry| entry.path().join("p2pmem").exists())
        })
        .unwrap_or(false)
}

/// The udev record cuFile consults for the block device holding a file. Without
/// `ID_FS_USAGE=filesystem` in it, cuFileHandleRegister fails (error 5027 in VMs whose udev
/// never ran).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UdevCheck {
    /// `major:minor` of the device holding the file.
    pub device: String,
    /// `/run/udev/data/b<major>:<minor>`.
    pub record: PathBuf,
    pub status: UdevStatus,
    /// Filesystem type of the mount holding the file (from /proc/self/mountinfo).
    pub fs_type: Option<String>,
    /// What the mount table names as the mount's source. cuFile looks the device up in the
    /// mount table by name; a source such as `/dev/root` (a kernel `root=` mount) does not
    /// name the real block device, and cuFile cannot identify the volume.
    pub mount_source: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UdevStatus {
    /// The record exists and says `E:ID_FS_USAGE=filesystem`.
    Ok,
    /// No record for the device.
    MissingRecord,
    /// A record exists without `E:ID_FS_USAGE=filesystem`.
    MissingFsUsage,
    /// The file is on a virtual filesystem (major 0: tmpfs, overlay, ...) with no block
    /// device; cuFile cannot do direct I/O there at all.
    NoBlockDevice,
}

impl UdevCheck {
    /// Checks the udev record for the device holding `path`, reading records from
    /// `udev_data_dir` (normally `/run/udev/data`).
    pub fn for_path_in(path: &Path, udev_data_dir: &Path) -> std::io::Result<UdevCheck> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(path)?.dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let device = format!("{major}:{minor}");
        let record = udev_data_dir.join(format!("b{device}"));
        let status = if major == 0 {
            UdevStatus::NoBlockDevice
        } else {
            match std::fs::read_to_string(&record) {
                Err(_) => UdevStatus::MissingRecord,
                Ok(text) if text.lines().any(|l| l.trim() == "E:ID_FS_USAGE=filesystem") => {
                    UdevStatus::Ok
                }
                Ok(_) => UdevStatus::MissingFsUsage,
            }
        };
        let (fs_type, mount_source) = mount_of_device(&device).unzip();
        Ok(UdevCheck {
            device,
            record,
            status,
            fs_type,
            mount_source,
        })
    }

    pub fn for_path(path: &Path) -> std::io::Result<UdevCheck> {
        Self::for_path_in(path, Path::new("/run/udev/data"))
    }

    /// The shell command that fixes the record, when one is needed. It writes a record the
    /// way udevd would: an `I:` line (microseconds since boot when the device was initialised),
    /// `ID_FS_USAGE` (what cuFile reports missing) and `ID_FS_TYPE`, so that both libudev's
    /// "initialised" check and cuFile's volume lookup find what they read.
    pub fn fix(&self) -> Option<String> {
        match self.status {
            UdevStatus::MissingRecord | UdevStatus::MissingFsUsage => Some(self.record_command()),
            UdevStatus::Ok | UdevStatus::NoBlockDevice => None,
        }
    }

    /// The command that (re)writes the full record, whatever the current status.
    pub fn record_command(&self) -> String {
        let fs_type = self.fs_type.as_deref().unwrap_or("ext4");
        format!(
            "printf 'I:%s\\nE:ID_FS_USAGE=filesystem\\nE:ID_FS_TYPE={fs_type}\\n' \
             \"$(awk '{{printf \"%d\", $1 * 1000000}}' /proc/uptime)\" | sudo tee {} >/dev/null",
            self.record.display()
        )
    }

    /// Whether the mount table names something other than a `/dev/...` node of this device
    /// (e.g. `/dev/root`), which keeps cuFile from matching the volume to its mount.
    pub fn mount_source_is_alias(&self) -> bool {
        self.mount_source.as_deref().is_some_and(|source| {
            source == "/dev/root"
                || !source.starts_with("/dev/")
                || !device_node_matches(source, &self.device)
        })
    }
}

/// Filesystem type and mount source of the mount of block device `major:minor`.
fn mount_of_device(device: &str) -> Option<(String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo_lookup(&text, device)
}

/// Parses mountinfo lines: `id parent major:minor root mountpoint opts [optional...] - fstype
/// source superopts`.
fn mountinfo_lookup(text: &str, device: &str) -> Option<(String, String)> {
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        if fields.nth(2)? != device {
            return None;
        }
        let mut after = line.split(" - ").nth(1)?.split_whitespace();
        Some((after.next()?.to_string(), after.next()?.to_string()))
    })
}

/// Whether `/dev/...` path `node` is a block device node with number `device` (major:minor).
fn device_node_matches(node: &str, device: &str) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    std::fs::metadata(node).is_ok_and(|m| {
        m.file_type().is_block_device()
            && format!("{}:{}", libc::major(m.rdev()), libc::minor(m.rdev())) == device
    })
}

/// Explanation attached to a failed cuFileHandleRegister of `path`.
pub(crate) fn explain_registration_failure(path: &Path, code: u32) -> String {
    let udev = UdevCheck::for_path(path).ok();
    if let Some(check) = &udev
        && let Some(fix) = check.fix()
    {
        return format!(
            "udev has no ID_FS_USAGE for block device {} ({} is {}); cuFile refuses files \
             whose filesystem it cannot identify. Fix: {fix}",
            check.device,
            check.record.display(),
            if check.status == UdevStatus::MissingRecord {
                "missing"
            } else {
                "without E:ID_FS_USAGE=filesystem"
            }
        );
    }
    if let Some(check) = &udev
        && check.status == UdevStatus::Ok
        && code == cufile_sys::CU_FILE_HANDLE_NOT_REGISTERED
    {
        let mount = if check.mount_source_is_alias() {
            format!(
                " The mount table names the volume {:?}, not a /dev node of {}: cuFile may \
                 fail to match it (mount the device by its real node, e.g. a second mount of \
                 /dev/<disk>, and keep the model there).",
                check.mount_source.as_deref().unwrap_or("?"),
                check.device
            )
        } else {
            String::new()
        };
        return format!(
            "the udev record {} has ID_FS_USAGE, yet cuFile still refuses the file. Rewrite the \
             full record (an I: line marks it initialised): {}.{mount} For cuFile's own reason \
             set CUFILE_ENV_PATH_JSON to a cufile.json with \"logging\": {{\"level\": \"TRACE\"}} \
             and read cufile.log",
            check.record.display(),
            check.record_command()
        );
    }
    if udev
        .as_ref()
        .is_some_and(|c| c.status == UdevStatus::NoBlockDevice)
    {
        return "the file is on a filesystem without a block device (tmpfs, overlay, ...), \
                which cuFile cannot read from; keep models on an ext4/xfs volume"
            .to_string();
    }
    match code {
        cufile_sys::CU_FILE_DIO_NOT_SET | cufile_sys::CU_FILE_INVALID_FILE_OPEN_FLAG => {
            "the file was not opened with O_DIRECT (its filesystem may refuse O_DIRECT)".into()
        }
        cufile_sys::CU_FILE_INVALID_FILE_TYPE => {
            "cuFile does not support this file type or filesystem".into()
        }
        cufile_sys::CU_FILE_HANDLE_NOT_REGISTERED => {
            "cuFile could not identify the file's filesystem; run with CUFILE_LOGGING_LEVEL=TRACE \
             and read cufile.log"
                .into()
        }
        _ => "see cufile.log in the working directory for cuFile's reason".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_give_type_and_source() {
        let text = "22 1 0:21 / /proc rw,nosuid - proc proc rw\n\
                    25 1 254:0 / / rw,relatime shared:1 - ext4 /dev/root rw\n\
                    30 25 259:1 / /data rw - xfs /dev/nvme0n1p1 rw\n";
        assert_eq!(
            mountinfo_lookup(text, "254:0"),
            Some(("ext4".into(), "/dev/root".into()))
        );
        assert_eq!(
            mountinfo_lookup(text, "259:1"),
            Some(("xfs".into(), "/dev/nvme0n1p1".into()))
        );
        assert_eq!(mountinfo_lookup(text, "8:1"), None);
        let check = UdevCheck {
            device: "254:0".into(),
            record: "/run/udev/data/b254:0".into(),
            status: UdevStatus::Ok,
            fs_type: Some("ext4".into()),
            mount_source: Some("/dev/root".into()),
        };
        assert!(check.mount_source_is_alias());
    }

    #[test]
    fn udev_check_reads_records_and_proposes_the_exact_fix() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let udev = tempfile::tempdir().unwrap();
        let check = UdevCheck::for_path_in(&file, udev.path()).unwrap();
        if check.status == UdevStatus::NoBlockDevice {
            eprintln!("temp dir is on a virtual filesystem; record logic checked below only");
            assert_eq!(check.fix(), None);
            return;
        }
        assert_eq!(check.status, UdevStatus::MissingRecord);
        let record = udev.path().join(format!("b{}", check.device));
        assert_eq!(check.record, record);
        let fix = check.fix().unwrap();
        assert!(
            fix.contains("I:%s")
                && fix.contains("E:ID_FS_USAGE=filesystem")
                && fix.contains("E:ID_FS_TYPE=")
                && fix.contains(&format!("sudo tee {}", record.display())),
            "{fix}"
        );
        std::fs::write(&record, "E:ID_FS_TYPE=ext4\n").unwrap();
        let check = UdevCheck::for_path_in(&file, udev.path()).unwrap();
        assert_eq!(check.status, UdevStatus::MissingFsUsage);
        assert!(check.fix().is_some());
        std::fs::write(&record, "E:ID_FS_TYPE=ext4\nE:ID_FS_USAGE=filesystem\n").unwrap();
        let check = UdevCheck::for_path_in(&file, udev.path()).unwrap();
        assert_eq!(check.status, UdevStatus::Ok);
        assert_eq!(check.fix(), None);
    }
}
