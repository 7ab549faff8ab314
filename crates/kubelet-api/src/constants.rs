//! Names and numbers fixed by the wire contracts and the upstream kubelet's
//! on-disk layout.

/// Plugin type string for CSI drivers (`PluginInfo.type`).
pub const CSI_PLUGIN_TYPE: &str = "CSIPlugin";
/// Plugin type string for device plugins registered through the plugin watcher.
pub const DEVICE_PLUGIN_TYPE: &str = "DevicePlugin";
/// Plugin type string for dynamic resource allocation drivers.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// The kubelet's default root directory. Rustlet never touches it unless a
/// user passes it explicitly.
pub const DEFAULT_ROOT_DIR: &str = "/var/lib/kubelet";
/// Directory, under the root dir, that the plugin watcher watches.
pub const PLUGINS_REGISTRY_DIR: &str = "plugins_registry";
/// Directory, under the root dir, holding `kubelet.sock` and device plugin sockets.
pub const DEVICE_PLUGINS_DIR: &str = "device-plugins";
/// The node's device-plugin registration socket name.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// Device plugin API version string.
pub const DEVICE_PLUGIN_VERSION: &str = "v1beta1";

/// Node annotation holding a JSON map of CSI driver name to node ID.
pub const CSI_NODE_ID_ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

/// The kubelet API's port (HTTPS).
pub const KUBELET_PORT: u16 = 10250;

/// The DRA versions the node serves, newest first, as a driver lists them
/// in `PluginInfo.supported_versions` (`<package>.<service>`).
pub const DRA_PLUGIN_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];

/// The PodResources API's directory under the root dir; its socket is
/// [`KUBELET_SOCKET`] there.
pub const POD_RESOURCES_DIR: &str = "pod-resources";

/// The directory under the root dir where plugins keep their own sockets
/// (`plugins/<driver>/…`), beside `plugins_registry/`.
pub const PLUGINS_DIR: &str = "plugins";
