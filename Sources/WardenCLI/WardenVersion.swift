/// This build's version: printed by `warden --version`, logged when `warden run` starts, and
/// exported as `warden_build_info{version}`.
public enum WardenVersion {
    public static let current = "0.9.0"
}
